"""Train the EAGLE-style draft head of the `tiny` model (`checkpoints/tiny-eagle`).

The head (EAGLE, Li et al. 2024) reads the target's last hidden state h_p (its final
norm's output) and the embedding of the next token t_{p+1}: ``fc([h_p; embed(t_{p+1})])``,
one Llama decoder layer and a final RMSNorm give g_p, which stands for h_{p+1}; the
target's tied LM head turns it into a guess of t_{p+2}. The target stays frozen (its
embedding and LM head are not part of the head's checkpoint). The loss is EAGLE's: a
smooth L1 regression of g_p onto h_{p+1} plus 0.1 x the cross-entropy of the head's
token distribution against the target's at p+1; the input features get uniform noise
(EAGLE's robustness to its own feature errors at deeper drafts). Forward passes run
under bfloat16 autocast (the CPU's AMX), losses and weights in float32.

Data: the training split of the tiny pair's corpus (``tiny_model/corpus.py``), files in
a fixed hashed order until ``--tokens`` training tokens; the validation split measures
top-1 agreement with the target (the acceptance rate of a greedy first draft).

    nice -n 19 python examples/train_eagle_head.py --venv .venv --threads 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tiny_model.corpus import build_corpus
from tiny_model.runtime import configure_torch
from tiny_model.tokenizer import encode_files, load_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent


class EagleHeadModule(nn.Module):
    """The trainable head with Hugging Face Llama modules, named as servelab loads them:
    ``fc``, ``model.layers.0.*``, ``model.norm``."""

    def __init__(self, config):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([LlamaDecoderLayer(config, 0)])
        self.model.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, features: torch.Tensor, next_embeddings: torch.Tensor) -> torch.Tensor:
        """features, next_embeddings: [B, L, hidden] -> g: [B, L, hidden] (causal)."""
        x = self.fc(torch.cat((features, next_embeddings), dim=-1))
        positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        out = self.model.layers[0](x, attention_mask=None, position_ids=positions,
                                   position_embeddings=self.rotary(x, positions))
        return self.model.norm(out[0] if isinstance(out, tuple) else out)


def head_config(target_config) -> dict:
    """The head's config.json: the target's layer shape, one layer."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "vocab_size", "hidden_act")
    config = {key: getattr(target_config, key) for key in keys}
    config["rope_theta"] = (getattr(target_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return {"architectures": ["EagleHead"], "model_type": "eagle_head", "num_hidden_layers": 1, **config}


def token_rows(tokenizer, files, tokens: int, seq_len: int) -> torch.Tensor:
    """[n, seq_len] rows of ``files`` (in hashed key order) until ``tokens`` tokens."""
    order = sorted(files, key=lambda f: hashlib.sha256(f.key.encode()).digest())
    picked, total = [], 0
    for f in order:
        picked.append(f)
        total += f.size / 3.3  # about 3.3 bytes per token (training.json of tiny)
        if total > tokens * 1.1:
            break
    stream = encode_files(tokenizer, tuple(picked))
    n = min(len(stream) // seq_len, math.ceil(tokens / seq_len))
    return torch.as_tensor(stream[: n * seq_len].astype(np.int64)).view(n, seq_len)


def step_loss(head, target, ids: torch.Tensor, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of one batch of token rows and the head's top-1 agreement with the target."""
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        hidden = target.model(ids).last_hidden_state.float()
        target_logits = target.lm_head(hidden[:, 1:]).float()
        embeddings = target.model.embed_tokens(ids[:, 1:]).float()
    features = hidden[:, :-1]
    if noise:
        features = features + (torch.rand_like(features) - 0.5) * noise
    with torch.autocast("cpu", torch.bfloat16):
        g = head(features, embeddings).float()
        logits = target.lm_head(g).float()
    regression = nn.functional.smooth_l1_loss(g, hidden[:, 1:])
    teacher = target_logits.softmax(-1)
    classification = -(teacher * logits.log_softmax(-1)).sum(-1).mean()
    agree = (logits.argmax(-1)[:, :-1] == target_logits.argmax(-1)[:, :-1]).float().mean()
    return regression + 0.1 * classification, agree


def main(argv: list[str] | None = None) -> None:
    """Train, evaluate and save the head."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, required=True, help="the corpus' virtual environment")
    parser.add_argument("--target", type=Path, default=REPO_ROOT / "checkpoints/tiny")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "checkpoints/tiny-eagle")
    parser.add_argument("--tokens", type=int, default=4_000_000)
    parser.add_argument("--val-tokens", type=int, default=131_072)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--noise", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    configure_torch(args.threads)
    torch.manual_seed(args.seed)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
    tokenizer = load_tokenizer(args.target / "tokenizer.json")
    corpus = build_corpus(args.venv)
    train_rows = token_rows(tokenizer, corpus.train, args.tokens, args.seq_len)
    val_rows = token_rows(tokenizer, corpus.val, args.val_tokens, args.seq_len)
    config = head_config(target.config)
    from transformers import LlamaConfig

    head = EagleHeadModule(LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")},
                                       attn_implementation="sdpa"))
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    steps = len(train_rows) // args.batch_size
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=steps, pct_start=0.05)
    print(f"{sum(p.numel() for p in head.parameters()):,} parameters; {steps} steps of {args.batch_size} x "
          f"{args.seq_len} tokens", flush=True)
    log, started = [], time.perf_counter()
    for step in range(steps):
        loss, agree = step_loss(head, target, train_rows[step * args.batch_size:(step + 1) * args.batch_size],
                                args.noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 20 == 0 or step == steps - 1:
            log.append({"step": step, "tokens": (step + 1) * args.batch_size * args.seq_len,
                        "loss": round(loss.item(), 4), "top1_agreement": round(agree.item(), 4),
                        "seconds": round(time.perf_counter() - started, 1)})
            print(json.dumps(log[-1]), flush=True)
    head.eval()
    with torch.no_grad():
        scores = [step_loss(head, target, val_rows[i:i + args.batch_size], 0.0) for i in
                  range(0, len(val_rows), args.batch_size)]
    val = {"loss": round(sum(s[0].item() for s in scores) / len(scores), 4),
           "top1_agreement": round(sum(s[1].item() for s in scores) / len(scores), 4)}
    print(f"validation: {val}", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    weights = {name: p.detach().to(torch.bfloat16).contiguous() for name, p in head.state_dict().items()
               if not name.startswith("rotary")}
    save_file(weights, str(args.out_dir / "model.safetensors"), metadata={"format": "pt"})
    (args.out_dir / "config.json").write_text(json.dumps({**config, "target": args.target.name}, indent=2) + "\n")
    record = {"command": "python " + " ".join(map(shlex.quote, [Path(sys.argv[0]).as_posix(), *sys.argv[1:]])),
              "target": args.target.name, "parameters": sum(w.numel() for w in weights.values()),
              "train_tokens": int(train_rows.numel()), "args": {k: str(v) for k, v in vars(args).items()},
              "torch": torch.__version__, "train_minutes": round((time.perf_counter() - started) / 60, 1),
              "final_train_loss": log[-1]["loss"], "validation": val, "log": log}
    (args.out_dir / "training.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
