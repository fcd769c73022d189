"""Real 1P1D serving on this CPU against the same runs simulated on the virtual clock.

Each round profiles the model at one thread (``servelab-bench mode=profile``), starts
``servelab-serve deployment=disaggregated`` (a prefill and a decode instance, one core
and one thread each) and measures it with ``servelab-bench target=http`` at every rate;
then every real run is simulated (``executor=simulated cost_model=profiled
deployment=disaggregated``) with its round's table and the same workload seed. The table
is ``validate_cost_models.py cpu``'s: per rate and metric, the medians over the rounds and
their error::

    python benchmarks/validate_disaggregation.py --rounds 5 --rates 2 4 --out runs/disaggregation

The model is the 26M-parameter random Llama of the mixed engine's validation
(docs/results/simulation.md), so that a step costs milliseconds and the HTTP server's own
fixed cost per request (about 3 ms here) is small beside a prefill.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from servelab.testing.server_process import ServerProcess


def bench(*overrides: str) -> None:
    """One ``servelab-bench`` run; raises if it fails."""
    subprocess.run([str(Path(sys.executable).with_name("servelab-bench")), *overrides], check=True,
                   stdout=subprocess.DEVNULL)


def main() -> None:
    """Profile, serve and measure each round, simulate every run, print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0])
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--workload", default="sharegpt", help="the workload preset (conf/workload/)")
    parser.add_argument("--out", default="runs/disaggregation")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    checkpoint = out / "26m"
    if not (checkpoint / "config.json").exists():
        from servelab.bench.random_llama import make_checkpoint

        make_checkpoint(str(checkpoint), "26m")
    model = ["model=local", f"model.path={checkpoint}", "model.dtype=float32", "use_tqdm=false"]
    workload = [f"workload={args.workload}", "workload.arrival=poisson", f"workload.num_requests={args.requests}"]
    for round_ in range(1, args.rounds + 1):
        bench(*model, "torch_threads=1", "mode=profile", f"hydra.run.dir={out}/round-{round_}")
        server = ServerProcess.servelab(out / f"server-{round_}.log", *model[:3], "deployment=disaggregated")
        try:
            for rate in args.rates:
                bench(*model, *workload, "target=http", f"target.url={server.url}", f"workload.rate={rate:g}",
                      f"workload.seed={round_}", f"hydra.run.dir={out}/{args.workload}-rate{rate:g}/real-{round_}")
        finally:
            server.stop()
    for round_ in range(1, args.rounds + 1):
        for rate in args.rates:
            bench(*model, *workload, "torch_threads=1", "executor=simulated", "cost_model=profiled", "hardware=local",
                  f"cost_model.table={out}/round-{round_}/profile.json", "deployment=disaggregated",
                  "deployment.link=pcie", f"workload.rate={rate:g}", f"workload.seed={round_}",
                  f"hydra.run.dir={out}/{args.workload}-rate{rate:g}/sim-{round_}")
    subprocess.run([sys.executable, str(Path(__file__).with_name("validate_cost_models.py")), "cpu", str(out)],
                   check=True)


if __name__ == "__main__":
    main()
