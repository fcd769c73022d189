"""Train servelab's embedded tiny model pair: a ~5 M parameter target and a ~1 M draft.

Both are Llama-architecture causal LMs trained from scratch on the Python source of the
standard library, sharing one byte-level BPE tokenizer (vocabulary 4096). Everything is
deterministic: sorted corpus, fixed seed, fixed step counts, one torch thread.

    python examples/train_tiny_model.py                  # tokenizer + target + draft
    python examples/train_tiny_model.py --only draft     # retrain only the draft
    python examples/train_tiny_model.py --smoke          # a fast end-to-end check

The checkpoints land in checkpoints/tiny and checkpoints/tiny-draft (bfloat16 safetensors,
tokenizer files, generation_config.json and a training.json record).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from tokenizers import (  # noqa: E402
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
EOT = "<|endoftext|>"
VOCAB_SIZE = 4096
CONTEXT_LENGTH = 512
SAMPLE_PROMPT = "def fibonacci(n):"
# Path components that exclude a file from the corpus: installed packages, test suites,
# the IDLE sources, and generated data tables (codec maps, pydoc topic strings).
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "idlelib", "__pycache__",
                 "encodings", "pydoc_data"}


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one of the two models."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


TARGET = ModelSpec("tiny", hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2,
                   intermediate_size=512)
DRAFT = ModelSpec("tiny-draft", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=384)


@dataclass
class Corpus:
    """The train/validation split of the corpus: relative file paths and file texts."""

    train_files: list[str]
    val_files: list[str]
    train_texts: list[str]
    val_texts: list[str]


def stdlib_python_files(limit: int | None = None) -> list[Path]:
    """Return the sorted ``.py`` files of the standard library that form the corpus.

    ``limit`` keeps only the first files (used by ``--smoke``).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
        and not p.name.startswith("_sysconfigdata")
    )
    return files[:limit] if limit else files


def load_corpus(limit: int | None = None, val_every: int = 20) -> Corpus:
    """Read the corpus and split it by file: sorted index ``% val_every == 0`` is validation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train_files, val_files, train_texts, val_texts = [], [], [], []
    for index, path in enumerate(stdlib_python_files(limit)):
        text = path.read_text(encoding="utf-8", errors="replace")
        rel = str(path.relative_to(root))
        if index % val_every == 0:
            val_files.append(rel)
            val_texts.append(text)
        else:
            train_files.append(rel)
            train_texts.append(text)
    return Corpus(train_files, val_files, train_texts, val_texts)


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts``; ``<|endoftext|>`` is bos, eos and pad."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        model_max_length=CONTEXT_LENGTH,
        clean_up_tokenization_spaces=False,
    )


def check_roundtrip(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> None:
    """Raise if ``decode(encode(text))`` does not reproduce any of ``texts`` exactly."""
    for text in texts:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if tokenizer.decode(ids) != text:
            raise RuntimeError("tokenizer does not round-trip Python source exactly")


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    """Save the tokenizer files so that ``AutoTokenizer.from_pretrained(folder)`` loads them.

    ``tokenizer_class`` is pinned to ``PreTrainedTokenizerFast`` and a
    ``special_tokens_map.json`` is written so that older transformers releases load it too.
    """
    tokenizer.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": EOT, "eos_token": EOT, "pad_token": EOT}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def token_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """Encode ``texts`` into one stream, each document preceded by ``<|endoftext|>``."""
    eot = tokenizer.convert_tokens_to_ids(EOT)
    stream: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream.append(eot)
        stream.extend(ids)
    stream.append(eot)
    return torch.tensor(stream, dtype=torch.long)


def pack(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a token stream into non-overlapping ``[n, seq_len]`` sequences (tail dropped)."""
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


def build_model(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """Create a freshly initialised float32 Llama model for ``spec`` with tied embeddings."""
    eot = tokenizer.convert_tokens_to_ids(EOT)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=CONTEXT_LENGTH,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def count_parameters(model: torch.nn.Module) -> int:
    """Count unique parameters (tied embeddings are counted once)."""
    return sum(p.numel() for p in model.parameters())


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup to ``peak``, then cosine decay to ``floor * peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, sequences: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy of ``model`` (float32) over ``sequences``, batch by batch."""
    model.eval()
    losses = [model(input_ids=batch, labels=batch).loss.item()
              for batch in sequences.split(batch_size)]
    model.train()
    return sum(losses) / len(losses)


@dataclass
class TrainArgs:
    """Hyper-parameters of one training run."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int
    weight_decay: float
    autocast: bool
    log_every: int
    seed: int


def train(model: LlamaForCausalLM, train_seqs: torch.Tensor, args: TrainArgs) -> float:
    """Train ``model`` in place for ``args.steps`` steps.

    Returns the mean training loss over the last logging window.

    Batches are drawn without replacement from a seeded permutation of the packed training
    sequences, reshuffled every epoch.
    """
    generator = torch.Generator().manual_seed(args.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    order = torch.randperm(len(train_seqs), generator=generator)
    cursor = 0
    window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
    last_window = float("nan")
    model.train()
    for step in range(args.steps):
        if cursor + args.batch_size > len(order):
            order = torch.randperm(len(train_seqs), generator=generator)
            cursor = 0
        batch = train_seqs[order[cursor: cursor + args.batch_size]]
        cursor += args.batch_size
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window_loss += loss.item()
        window_steps += 1
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            elapsed = time.perf_counter() - window_start
            last_window = window_loss / window_steps
            tokens_per_s = window_steps * args.batch_size * args.seq_len / elapsed
            print(f"  step {step + 1:>6}/{args.steps}  loss {last_window:.4f}  "
                  f"lr {optimizer.param_groups[0]['lr']:.2e}  {tokens_per_s:,.0f} tok/s",
                  flush=True)
            window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
    return last_window


def save_checkpoint(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
                    folder: Path) -> None:
    """Save ``model`` as bfloat16 safetensors with its tokenizer and generation config."""
    folder.mkdir(parents=True, exist_ok=True)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, do_sample=False,
    )
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, folder)


def greedy_sample(folder: Path, prompt: str = SAMPLE_PROMPT, max_new_tokens: int = 64) -> str:
    """Reload a checkpoint with the Auto classes and greedily complete ``prompt``."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def folder_bytes(folder: Path) -> int:
    """Total size in bytes of the files in ``folder``."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def check_existing_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    """Raise if ``folder`` holds a tokenizer that differs from ``tokenizer``.

    Keeps the target and draft on one vocabulary when only one of them is retrained.
    """
    path = folder / "tokenizer.json"
    if not path.exists():
        return
    saved = json.loads(path.read_text())["model"]
    fresh = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    if saved["vocab"] != fresh["vocab"] or saved["merges"] != fresh["merges"]:
        raise RuntimeError(f"{folder} holds a different tokenizer; retrain both models")


def run_model(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast, corpus_info: dict,
              train_seqs: torch.Tensor, val_seqs: torch.Tensor, args: TrainArgs,
              folder: Path, command: str) -> dict:
    """Train, evaluate, save and reload one model; write and return its training record."""
    torch.manual_seed(args.seed)
    model = build_model(spec, tokenizer)
    params = count_parameters(model)
    print(f"[{spec.name}] {params:,} parameters, {args.steps} steps of "
          f"{args.batch_size}x{args.seq_len} tokens, autocast={args.autocast}", flush=True)
    start = time.perf_counter()
    train_loss = train(model, train_seqs, args)
    minutes = (time.perf_counter() - start) / 60
    val_loss = evaluate(model, val_seqs, args.batch_size)
    print(f"[{spec.name}] trained in {minutes:.2f} min; final train loss {train_loss:.4f}, "
          f"validation loss {val_loss:.4f}", flush=True)
    save_checkpoint(model, tokenizer, folder)
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    val_loss_bf16 = evaluate(reloaded, val_seqs, args.batch_size)
    sample = greedy_sample(folder)
    print(f"[{spec.name}] validation loss of the saved bfloat16 weights {val_loss_bf16:.4f}; "
          f"{folder_bytes(folder) / 1e6:.2f} MB in {folder}", flush=True)
    print(f"[{spec.name}] greedy sample:\n{sample}\n", flush=True)
    record = {
        "name": spec.name,
        "command": command,
        "seed": args.seed,
        "architecture": asdict(spec),
        "parameters": params,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "tokens_seen": args.steps * args.batch_size * args.seq_len,
        "peak_lr": args.lr,
        "warmup_steps": args.warmup,
        "weight_decay": args.weight_decay,
        "bf16_autocast": args.autocast,
        "minutes": round(minutes, 2),
        "final_train_loss": round(train_loss, 4),
        "val_loss": round(val_loss, 4),
        "val_loss_saved_bf16": round(val_loss_bf16, 4),
        "val_tokens": val_seqs.numel(),
        "corpus": corpus_info,
        "greedy_sample": sample,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    (folder / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["target", "draft", "both"], default="both")
    parser.add_argument("--steps-target", type=int, default=3000)
    parser.add_argument("--steps-draft", type=int, default=3000)
    parser.add_argument("--lr-target", type=float, default=2e-3)
    parser.add_argument("--lr-draft", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--val-sequences", type=int, default=256,
                        help="number of packed validation sequences the loss is averaged over")
    parser.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=True,
                        help="bfloat16 autocast during training (faster on CPUs with bf16 "
                             "matrix units; weights and optimizer state stay float32)")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="parent folder of tiny/ and tiny-draft/ "
                             "(default: checkpoints/, or outputs/smoke/ with --smoke)")
    parser.add_argument("--smoke", action="store_true",
                        help="a few steps on a small corpus slice, for a fast check")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Build the corpus and tokenizer, then train and save the requested models."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if args.smoke:
        args.steps_target = args.steps_draft = 6
        args.val_sequences = 4
        args.log_every = 2
    out_dir = args.out_dir or REPO_ROOT / ("outputs/smoke" if args.smoke else "checkpoints")
    command = shlex.join(["python", os.path.relpath(__file__, REPO_ROOT), *sys.argv[1:]])

    start = time.perf_counter()
    corpus = load_corpus(limit=40 if args.smoke else None)
    tokenizer = train_tokenizer(corpus.train_texts)
    check_roundtrip(tokenizer, corpus.train_texts[:50] + corpus.val_texts)
    train_stream = token_stream(tokenizer, corpus.train_texts)
    val_stream = token_stream(tokenizer, corpus.val_texts)
    train_seqs = pack(train_stream, args.seq_len)
    val_seqs = pack(val_stream, args.seq_len)[: args.val_sequences]
    corpus_info = {
        "source": "Python standard library .py files",
        "python": sys.version.split()[0],
        "train_files": len(corpus.train_files),
        "val_files": len(corpus.val_files),
        "train_bytes": sum(len(t.encode()) for t in corpus.train_texts),
        "val_bytes": sum(len(t.encode()) for t in corpus.val_texts),
        "train_tokens": train_stream.numel(),
        "val_tokens": val_stream.numel(),
        "tokenizer_vocab": len(tokenizer),
    }
    print(f"corpus: {json.dumps(corpus_info)} "
          f"({time.perf_counter() - start:.1f} s incl. tokenizer training)", flush=True)

    jobs = []
    if args.only in ("target", "both"):
        jobs.append((TARGET, args.steps_target, args.lr_target))
    if args.only in ("draft", "both"):
        jobs.append((DRAFT, args.steps_draft, args.lr_draft))
    for spec in {TARGET, DRAFT} - {job[0] for job in jobs}:
        check_existing_tokenizer(tokenizer, out_dir / spec.name)
    for spec, steps, lr in jobs:
        train_args = TrainArgs(
            steps=steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=lr,
            warmup=max(1, steps // 20), weight_decay=0.1, autocast=args.autocast,
            log_every=args.log_every, seed=args.seed,
        )
        run_model(spec, tokenizer, corpus_info, train_seqs, val_seqs, train_args,
                  out_dir / spec.name, command)
    total = sum(folder_bytes(out_dir / s.name) for s in (TARGET, DRAFT)
                if (out_dir / s.name).exists())
    print(f"checkpoints in {out_dir}: {total / 1e6:.2f} MB together", flush=True)


if __name__ == "__main__":
    main()
