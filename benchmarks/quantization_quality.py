"""Perplexity and greedy agreement of quantized weights (``model.quantization`` none, int8,
w8a8, int4, w4a8; ``int8+head`` / ``w8a8+head`` / ``int4+head`` / ``w4a8+head`` add
``model.quantization_lm_head=true``, ``int4+head4`` / ``w4a8+head4`` an int4 LM head) and of a
quantized KV cache (modes ``kv-int8``, ``kv-fp8_e4m3``: ``cache.kv_dtype``, float weights)
on the default model's held-out sets, scored by servelab itself.

    python benchmarks/quantization_quality.py --venv .venv --out /tmp/quality.json
    python benchmarks/quantization_quality.py --venv .venv --modes none kv-int8 kv-fp8_e4m3

Sets: the validation files of the tiny pair's corpus (``examples/tiny_model/corpus.py``,
rebuilt from ``--venv``'s site-packages and this Python's standard library: the split is a
hash of each file's path, so a venv holding servelab's ``[test]`` dependencies gives the
same files) and the held-out ``torch`` sources (``--torch-rows`` rows at even strides).
Each set is one token stream of the checkpoint's tokenizer (``<|endoftext|>`` before each
file) cut into rows of ``--row-tokens`` (511: the longest prompt a 512-position model
takes). Every row is one request, ``SamplingParams(max_tokens=1, prompt_logprobs=1)``,
which gives each position's logprob of the actual next token and the most likely token.

Per mode: perplexity (exp of the mean negative log-likelihood per predicted token) and
its change against ``none``; teacher-forced top-1 agreement with ``none`` (the share of
positions whose most likely token equals the float model's); greedy agreement on a fixed
prompt set (the first ``--prompt-tokens`` tokens of ``--prompts`` validation rows,
``--max-tokens`` greedy tokens, EOS ignored): the share of generated tokens equal to the
float model's position by position, and of completions equal in full.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BATCH_ROWS = 64
"""Rows scored per ``generate`` call (bounds the memory of the prompt logprob entries)."""


def token_rows(tokenizer, files, row_tokens: int, count: int | None, scratch: Path):
    """Rows [n, row_tokens] of the files' token stream (``count`` of them at even strides, or all)."""
    from tiny_model.evaluation import strided_rows
    from tiny_model.tokenizer import encode_files
    from tiny_model.trainer import pack

    rows = pack(encode_files(tokenizer, files, scratch), row_tokens)
    return rows if count is None else strided_rows(rows, count)


def score(llm, rows) -> tuple[float, list[int]]:
    """(summed negative log-likelihood, most likely token at every predicted position) of ``rows``."""
    from servelab import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    nll, argmax = 0.0, []
    for start in range(0, len(rows), BATCH_ROWS):
        batch = [row.tolist() for row in rows[start:start + BATCH_ROWS]]
        for row, output in zip(batch, llm.generate(batch, params, use_tqdm=False)):
            for token, entry in zip(row[1:], output.prompt_logprobs[1:]):
                nll -= entry[token].logprob
                argmax.append(next(t for t, logprob in entry.items() if logprob.rank == 1))
    return nll, argmax


HEADS = {"head": "true", "head4": "int4"}
"""A weight mode's ``+head`` suffix (the int8 LM head) or ``+head4`` (an int4 one)."""
KV_PREFIX = "kv-"
"""Modes ``kv-<cache.kv_dtype>`` quantize the KV cache instead of the weights."""


def mode_overrides(mode: str, group_size: int) -> list[str]:
    """The config overrides of one mode."""
    if mode.startswith(KV_PREFIX):
        return ["model.quantization=none", f"cache.kv_dtype={mode[len(KV_PREFIX):]}"]
    quantization, _, head = mode.partition("+")
    overrides = [f"model.quantization={quantization}"]
    if head:
        overrides.append(f"model.quantization_lm_head={HEADS[head]}")
    if quantization in ("int4", "w4a8"):
        overrides.append(f"model.quantization_group_size={group_size}")
    return overrides


def weight_bytes(llm) -> int:
    """Bytes of the model's parameters (quantized layers count their integers and scales)."""
    return sum(p.numel() * p.element_size() for p in llm.engine.executor.model.parameters())


def evaluate(mode: str, args, sets: dict, prompts: list[list[int]]) -> dict:
    """One mode's perplexities, argmax tokens and greedy completions."""
    from servelab import LLM, SamplingParams

    llm = LLM(str(args.model), overrides=["device=cpu", *mode_overrides(mode, args.group_size)])
    started = time.perf_counter()
    result: dict = {"mode": mode, "weight_bytes": weight_bytes(llm),
                    "kv_bytes_per_token": llm.engine.cache.spec.bytes_per_token}
    for name, rows in sets.items():
        nll, argmax = score(llm, rows)
        result[name] = {"perplexity": math.exp(nll / len(argmax)), "positions": len(argmax), "argmax": argmax}
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    result["greedy"] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def compare(result: dict, reference: dict, set_names) -> dict:
    """``result``'s summary against the float model's (``reference``)."""
    summary = {key: result[key] for key in ("mode", "weight_bytes", "kv_bytes_per_token", "seconds")}
    for name in set_names:
        ppl, float_ppl = result[name]["perplexity"], reference[name]["perplexity"]
        same = sum(a == b for a, b in zip(result[name]["argmax"], reference[name]["argmax"]))
        summary[name] = {"perplexity": round(ppl, 4), "change_percent": round(100 * (ppl / float_ppl - 1), 3),
                         "top1_agreement": round(same / result[name]["positions"], 4),
                         "positions": result[name]["positions"]}
    pairs = list(zip(result["greedy"], reference["greedy"]))
    equal = sum(a == b for got, expected in pairs for a, b in zip(got, expected))
    summary["greedy_token_agreement"] = round(equal / sum(len(e) for _, e in pairs), 4)
    summary["greedy_completions_equal"] = f"{sum(g == e for g, e in pairs)}/{len(pairs)}"
    return summary


def main(argv: list[str] | None = None) -> None:
    """Evaluate every mode, print a markdown table and write the JSON summary to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "checkpoints/tiny")
    parser.add_argument("--venv", type=Path, required=True, help="a venv holding servelab's [test] dependencies")
    parser.add_argument("--scratch", type=Path, default=Path.home() / ".cache/servelab-tiny-model")
    parser.add_argument("--modes", nargs="+", default=["none", "int8", "w8a8", "int8+head", "w8a8+head", "int4"],
                        help="weight modes (none, int8, w8a8, int4, w4a8; +head, +head4) and KV cache modes "
                             "(kv-int8, kv-fp8_e4m3)")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--row-tokens", type=int, default=511)
    parser.add_argument("--val-rows", type=int, default=None, help="validation rows at even strides (all)")
    parser.add_argument("--torch-rows", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "examples"))
    from tiny_model.corpus import build_corpus
    from transformers import AutoTokenizer

    corpus = build_corpus(args.venv)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sets = {"val": token_rows(tokenizer, corpus.val, args.row_tokens, args.val_rows, args.scratch),
            "torch": token_rows(tokenizer, corpus.torch, args.row_tokens, args.torch_rows, args.scratch)}
    from tiny_model.evaluation import strided_rows

    prompts = [row[:args.prompt_tokens].tolist() for row in strided_rows(sets["val"], args.prompts)]
    results = [evaluate(mode, args, sets, prompts) for mode in ["none", *[m for m in args.modes if m != "none"]]]
    summaries = [compare(result, results[0], sets) for result in results]
    report = {"command": " ".join(sys.argv), "corpus": corpus.summary(), "row_tokens": args.row_tokens,
              "group_size": args.group_size, "modes": summaries}
    print("| mode | weights MB | KV bytes/token | val ppl | change | val top-1 agree | torch ppl | change "
          "| torch top-1 agree | greedy tokens equal | completions equal |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in summaries:
        val, held = s["val"], s["torch"]
        print(f"| {s['mode']} | {s['weight_bytes'] / 1e6:.2f} | {s['kv_bytes_per_token']} | {val['perplexity']:.3f} "
              f"| {val['change_percent']:+.3f}% "
              f"| {val['top1_agreement']:.2%} | {held['perplexity']:.3f} | {held['change_percent']:+.2f}% "
              f"| {held['top1_agreement']:.2%} | {s['greedy_token_agreement']:.2%} | {s['greedy_completions_equal']} |")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
