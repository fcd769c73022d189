"""A resumable, deterministic training loop for one model of the pair.

Batches are a pure function of ``(seed, step)``: the packed training sequences are
permuted once per epoch by a generator seeded with ``seed`` and the epoch, and step ``s``
reads the next ``batch_size`` of them (step ``s + data_offset`` of that order when a run
continues another: it reads on where the earlier run stopped). The loop saves model,
optimizer and step to ``state.pt`` in its scratch folder every ``save_every_s`` seconds
and at the end, and a rerun with the same arguments continues from there.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TrainArgs:
    """Hyper-parameters of one training run (all of them enter the resume check)."""

    steps: int
    batch_size: int
    seq_len: int
    peak_lr: float
    warmup_steps: int
    final_lr_ratio: float       # lr at the last step, as a fraction of peak_lr
    weight_decay: float
    seed: int
    log_every: int
    eval_every: int
    data_offset: int = 0        # steps of the data order already read by the run continued
    init_from: str = ""         # checkpoint folder whose weights the run starts from


def lr_at(step: int, args: TrainArgs) -> float:
    """Linear warm-up to ``peak_lr`` over ``warmup_steps``, then cosine decay to
    ``final_lr_ratio * peak_lr`` at the last step."""
    if step < args.warmup_steps:
        return args.peak_lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - 1 - args.warmup_steps)
    floor = args.final_lr_ratio
    return args.peak_lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def pack(stream, seq_len: int) -> torch.Tensor:
    """Cut a token stream (numpy or torch) into ``[n, seq_len]`` int64 rows (tail dropped)."""
    n = len(stream) // seq_len
    return torch.as_tensor(stream[: n * seq_len].astype("int64")).view(n, seq_len)


def batch_indices(step: int, num_sequences: int, args: TrainArgs) -> torch.Tensor:
    """Row indices of step ``step``'s batch."""
    per_epoch = num_sequences // args.batch_size
    epoch, offset = divmod(step, per_epoch)
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + epoch)
    order = torch.randperm(num_sequences, generator=generator)
    return order[offset * args.batch_size: (offset + 1) * args.batch_size]


@torch.no_grad()
def evaluate(model, sequences: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats/token) of ``model`` over every predicted token of
    ``sequences`` (each row predicts its tokens 2..n from the ones before)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in sequences.split(batch_size):
        logits = model(input_ids=batch).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += batch[:, 1:].numel()
    model.train(was_training)
    return total / count


def make_optimizer(model, args: TrainArgs) -> torch.optim.AdamW:
    """AdamW, betas (0.9, 0.95); no weight decay on norms (1-D parameters)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.peak_lr, betas=(0.9, 0.95), eps=1e-8, foreach=True,
    )


def train(model, train_seqs: torch.Tensor, eval_seqs: torch.Tensor, args: TrainArgs,
          scratch: Path, label: str, save_every_s: float = 300.0) -> dict:
    """Train ``model`` in place to ``args.steps`` steps, resuming from ``scratch/state.pt``.

    Prints progress (training loss over the last window, learning rate, throughput, and
    every ``eval_every`` steps the loss on ``eval_seqs``). Returns the run's history:
    ``{"log": [...], "train_seconds": float}``.
    """
    scratch.mkdir(parents=True, exist_ok=True)
    state_path = scratch / "state.pt"
    optimizer = make_optimizer(model, args)
    step, history = 0, {"log": [], "train_seconds": 0.0}
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        if state["args"] != asdict(args):
            raise SystemExit(f"{state_path} was saved with other arguments: "
                             f"{json.dumps(state['args'])}; delete it to start over")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        print(f"[{label}] resumed at step {step} from {state_path}", flush=True)

    def save() -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save({"args": asdict(args), "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(), "step": step,
                    "history": history}, tmp)
        tmp.replace(state_path)

    model.train()
    window_loss, window_steps = 0.0, 0
    window_start = last_save = time.perf_counter()
    while step < args.steps:
        batch = train_seqs[batch_indices(step + args.data_offset, len(train_seqs), args)]
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        window_loss += loss.item()
        window_steps += 1
        if step % args.log_every == 0 or step == args.steps:
            now = time.perf_counter()
            history["train_seconds"] += now - window_start
            entry = {"step": step, "tokens": step * args.batch_size * args.seq_len,
                     "train_loss": round(window_loss / window_steps, 4), "lr": lr,
                     "seconds": round(history["train_seconds"], 1)}
            tok_s = window_steps * args.batch_size * args.seq_len / (now - window_start)
            line = (f"[{label}] step {step:>6}/{args.steps}  tokens {entry['tokens'] / 1e6:6.2f}M  "
                    f"loss {entry['train_loss']:.4f}  lr {lr:.2e}  {tok_s:,.0f} tok/s  "
                    f"{entry['seconds'] / 60:6.1f} min")
            if step % args.eval_every == 0 or step == args.steps:
                entry["eval_loss"] = round(evaluate(model, eval_seqs), 4)
                line += f"  eval {entry['eval_loss']:.4f}"
            print(line, flush=True)
            history["log"].append(entry)
            window_loss, window_steps = 0.0, 0
            if now - last_save >= save_every_s or step == args.steps:
                save()
                last_save = time.perf_counter()
            window_start = time.perf_counter()
    return history
