"""Train servelab's embedded model pair: the `tiny` target and the `tiny-draft` draft.

Both are Llama-architecture causal LMs trained from scratch on Python source (the standard
library plus the site-packages of a virtual environment holding servelab's dependencies,
without torch: see ``tiny_model/corpus.py``), sharing one byte-level BPE tokenizer.
Everything is deterministic for a given corpus and thread count: hashed file split,
fixed seed, batches a pure function of the step. Training is resumable: model, optimizer
and step are saved under ``--scratch`` every few minutes, and a rerun continues.

    python3 -m venv /tmp/corpus-venv && /tmp/corpus-venv/bin/pip install -e ".[test]"
    nice -n 19 python examples/train_tiny_model.py --venv /tmp/corpus-venv   # both models
    python examples/train_tiny_model.py --venv /tmp/corpus-venv --only draft # the draft
    python examples/train_tiny_model.py --venv /tmp/corpus-venv --smoke      # fast check
    python examples/train_tiny_model.py --venv /tmp/corpus-venv --init-from checkpoints \
        --steps-target 2200 --lr-target 1.5e-3 --steps-draft 8000 --lr-draft 2e-3  # train on

The checkpoints land in checkpoints/tiny and checkpoints/tiny-draft (bfloat16 safetensors,
tokenizer files, generation_config.json and a training.json record).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import torch  # noqa: E402

import transformers  # noqa: E402

from tiny_model.corpus import build_corpus, read_text  # noqa: E402
from tiny_model.evaluation import EvalSets, evaluate_checkpoint, load_eval_sets  # noqa: E402
from tiny_model.export import folder_bytes, greedy_sample, load_float32, save_checkpoint  # noqa: E402
from tiny_model.model import DRAFT, TARGET, ModelSpec, build_model, count_parameters  # noqa: E402
from tiny_model.runtime import configure_torch  # noqa: E402
from tiny_model.tokenizer import (  # noqa: E402
    EOT, check_roundtrip, fingerprint, load_tokenizer, train_tokenizer,
)
from tiny_model.trainer import TrainArgs, pack, train  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE_PROMPT = "def fibonacci(n):"


def get_tokenizer(corpus, scratch: Path, out_dir: Path, init_from: Path | None = None):
    """The tokenizer trained on the training files, cached as ``scratch/tokenizer.json``;
    with ``init_from``, the tokenizer of the checkpoints the run continues (the cached one
    must be the same).

    A checkpoint folder already holding a different tokenizer is noted: target and draft
    must share one vocabulary.
    """
    path = scratch / "tokenizer.json"
    if init_from is not None:
        tokenizer = load_tokenizer(init_from / TARGET.name / "tokenizer.json")
        if path.exists() and fingerprint(load_tokenizer(path)) != fingerprint(tokenizer):
            raise SystemExit(f"{path} is not the tokenizer of {init_from}; use another --scratch")
        scratch.mkdir(parents=True, exist_ok=True)
        tokenizer.backend_tokenizer.save(str(path))
    elif path.exists():
        tokenizer = load_tokenizer(path)
    else:
        start = time.perf_counter()
        tokenizer = train_tokenizer([read_text(f) for f in corpus.train])
        scratch.mkdir(parents=True, exist_ok=True)
        tokenizer.backend_tokenizer.save(str(path))
        print(f"tokenizer trained in {time.perf_counter() - start:.0f} s", flush=True)
    check_roundtrip(tokenizer, [read_text(f) for f in corpus.val])
    for spec in (TARGET, DRAFT):
        saved = out_dir / spec.name / "tokenizer.json"
        if saved.exists() and fingerprint(load_tokenizer(saved)) != fingerprint(tokenizer):
            print(f"note: {saved.parent} holds another tokenizer; it is replaced when that "
                  "model is trained (train both models)", flush=True)
    return tokenizer


def run_model(spec: ModelSpec, tokenizer, train_seqs: torch.Tensor, sets: EvalSets,
              args: TrainArgs, scratch: Path, folder: Path, record_base: dict) -> dict:
    """Train (or resume), save, evaluate and sample one model; write its training.json."""
    torch.manual_seed(args.seed)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    model = build_model(spec, len(tokenizer), eot, max_positions=args.seq_len)
    earlier = None
    if args.init_from:  # continuation() checked its record; keep it without the loss curve
        model.load_state_dict(load_float32(Path(args.init_from)).state_dict())
        earlier = json.loads((Path(args.init_from) / "training.json").read_text())
        earlier.pop("log", None)
    params = count_parameters(model)
    tokens = args.steps * args.batch_size * args.seq_len
    earlier_tokens = args.data_offset * args.batch_size * args.seq_len
    print(f"[{spec.name}] {params:,} parameters; {args.steps} steps of {args.batch_size} x "
          f"{args.seq_len} tokens = {tokens / 1e6:.1f}M tokens "
          f"({tokens / len(train_seqs) / args.seq_len:.2f} epochs)"
          + (f" after {earlier_tokens / 1e6:.1f}M in {args.init_from}" if earlier else ""), flush=True)
    history = train(model, train_seqs, sets.val_probe, args, scratch / spec.name, spec.name)
    save_checkpoint(model, tokenizer, folder)
    losses = evaluate_checkpoint(folder, sets)
    sample = greedy_sample(folder, SAMPLE_PROMPT)
    print(f"[{spec.name}] saved {folder_bytes(folder) / 1e6:.2f} MB in {folder}; "
          f"losses of the saved weights: {json.dumps(losses)}", flush=True)
    print(f"[{spec.name}] greedy sample:\n{sample}\n", flush=True)
    record = {
        "name": spec.name,
        **record_base,
        "architecture": asdict(spec),
        "parameters": params,
        "train_args": asdict(args),
        "tokens_seen": earlier_tokens + tokens,
        "train_minutes": round(history["train_seconds"] / 60, 1),
        **({"continues": earlier} if earlier else {}),
        "final_train_window_loss": history["log"][-1]["train_loss"],
        "losses": losses,
        "log": history["log"],
        "greedy_sample": sample,
    }
    (folder / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, required=True,
                        help="virtual environment whose site-packages join the corpus")
    parser.add_argument("--scratch", type=Path,
                        default=Path.home() / ".cache/servelab-tiny-model",
                        help="tokenizer, token streams and resumable training state")
    parser.add_argument("--only", choices=["target", "draft", "both"], default="both")
    parser.add_argument("--steps-target", type=int, default=2400)
    parser.add_argument("--steps-draft", type=int, default=2400)
    parser.add_argument("--lr-target", type=float, default=3e-3)
    parser.add_argument("--lr-draft", type=float, default=4e-3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--final-lr-ratio", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of each model's process")
    parser.add_argument("--sequential", action="store_true",
                        help="with --only both: train the models one after the other in this "
                             "process instead of in two processes at once (one per core)")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="parent folder of tiny/ and tiny-draft/ "
                             "(default: checkpoints/, or <scratch>/smoke/ with --smoke)")
    parser.add_argument("--smoke", action="store_true",
                        help="a few steps of both models and small evaluation sets")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="parent folder of tiny/ and tiny-draft/ to train on from: their weights "
                             "and tokenizer, a fresh optimizer and schedule, and the batches after "
                             "those their training.json records")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Build corpus, tokenizer and token streams, then train and save the requested models."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    configure_torch(args.threads)
    scratch = args.scratch / "smoke" if args.smoke else args.scratch
    out_dir = args.out_dir or (scratch / "checkpoints" if args.smoke else REPO_ROOT / "checkpoints")
    if args.smoke:
        args.steps_target = args.steps_draft = 6
        args.warmup_steps, args.log_every, args.eval_every = 2, 2, 4
    command = shlex.join(["python", os.path.relpath(__file__, REPO_ROOT), *sys.argv[1:]])

    start = time.perf_counter()
    corpus = build_corpus(args.venv)
    # Tokenizer and token streams are shared with full runs (same corpus, same cache).
    tokenizer = get_tokenizer(corpus, args.scratch, out_dir, args.init_from)
    sets = load_eval_sets(tokenizer, corpus, args.scratch, args.seq_len, small=args.smoke)
    train_seqs = pack(sets.train_stream, args.seq_len)
    summary = {**corpus.summary(), "venv": str(args.venv),
               "python": sys.version.split()[0], **sets.summary(),
               "tokenizer": {"vocab_size": len(tokenizer), "fingerprint": fingerprint(tokenizer)}}
    print(f"corpus: {json.dumps(summary)} ({time.perf_counter() - start:.0f} s)", flush=True)
    record_base = {"command": command, "threads": args.threads, "corpus": summary,
                   "torch": torch.__version__, "transformers": transformers.__version__}

    if args.only == "both" and not args.sequential:
        train_in_two_processes(argv if argv is not None else sys.argv[1:])
    else:
        train_models(args, tokenizer, train_seqs, sets, scratch, out_dir, record_base)
    total = sum(folder_bytes(out_dir / s.name) for s in (TARGET, DRAFT)
                if (out_dir / s.name).exists())
    print(f"checkpoints in {out_dir}: {total / 1e6:.2f} MB together; "
          f"{(time.perf_counter() - start) / 60:.1f} min in all", flush=True)


def train_in_two_processes(argv: list[str]) -> None:
    """Run this script twice at once, ``--only target`` and ``--only draft``: two
    single-threaded processes keep both cores busy, and on a shared machine they lose far
    less to other work than two threads of one process, which wait for each other at every
    operation. Corpus, tokenizer and token streams are cached by now, so both start at once.
    """
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--only", only])
             for only in ("target", "draft")]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"training processes exited with {codes}")


def train_models(args, tokenizer, train_seqs, sets, scratch, out_dir, record_base) -> None:
    """Train the models ``args.only`` names, one after the other."""
    jobs = []
    if args.only in ("target", "both"):
        jobs.append((TARGET, args.steps_target, args.lr_target))
    if args.only in ("draft", "both"):
        jobs.append((DRAFT, args.steps_draft, args.lr_draft))
    for spec, steps, lr in jobs:
        train_args = TrainArgs(
            steps=steps, batch_size=args.batch_size, seq_len=args.seq_len, peak_lr=lr,
            warmup_steps=args.warmup_steps, final_lr_ratio=args.final_lr_ratio,
            weight_decay=0.1, seed=args.seed, log_every=args.log_every,
            eval_every=args.eval_every,
            **(continuation(args.init_from / spec.name, args) if args.init_from else {}),
        )
        run_model(spec, tokenizer, train_seqs, sets, train_args, scratch,
                  out_dir / spec.name, record_base)


def continuation(folder: Path, args) -> dict:
    """``TrainArgs`` fields of a run that continues the checkpoint in ``folder``: its
    weights, and the data order from the step its own run (and those it continued) ended
    at. The batch shape and seed must be the ones that order was read with."""
    record = json.loads((folder / "training.json").read_text())
    earlier = record["train_args"]
    if (earlier["batch_size"], earlier["seq_len"], earlier["seed"]) != (args.batch_size, args.seq_len, args.seed):
        raise SystemExit(f"{folder} was trained with batch {earlier['batch_size']}, sequence "
                         f"{earlier['seq_len']} and seed {earlier['seed']}; continue it with the same")
    return {"data_offset": earlier.get("data_offset", 0) + earlier["steps"], "init_from": str(folder)}


if __name__ == "__main__":
    main()
