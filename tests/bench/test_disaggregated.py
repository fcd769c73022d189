"""``servelab-bench executor=simulated deployment=disaggregated``: prefill and decode pools
on one timeline, each hand-off priced over the link between them (small workloads)."""

from __future__ import annotations

import pytest

from servelab.bench.capacity import measure_capacity
from servelab.bench.runner import measure, open_system
from servelab.bench.targets.disaggregated import DisaggregatedSystem
from servelab.core.errors import ConfigError

BASE = ("executor=simulated", "hardware=a100-80gb", "model=llama-2-7b", "cache.num_blocks=512", "model.max_model_len=1280",
        "deployment=disaggregated",
        "workload.num_requests=16", "workload.arrival=poisson", "workload.rate=20", "workload.input_range=[32,256]",
        "workload.output_range=[4,16]", "warmup_requests=1")


def run(bench_config, *overrides: str) -> tuple[dict, DisaggregatedSystem]:
    """Measure the deployment of ``BASE`` + ``overrides``; its metrics and the (closed) system."""
    every = [*BASE, *overrides]
    cfg = bench_config(*every)
    system = DisaggregatedSystem(cfg, ["model=toy", "use_tqdm=false", *every])
    try:
        metrics = measure(system, cfg)
        assert_nothing_left(system)
    finally:
        system.close()
    return metrics, system


def assert_nothing_left(system: DisaggregatedSystem) -> None:
    """Every instance idle with every block free; no transfer in flight."""
    for pool in system.pools.values():
        for instance, connector in zip(pool.instances, pool.connectors):
            usage = instance.engine.cache.usage
            assert not instance.has_work() and not instance.engine.outputs.groups
            assert usage.used_blocks == 0 and usage.reserved_slots == 0
            assert instance.engine.cache.num_free_blocks == usage.total_blocks
            assert connector.num_in_flight == 0


@pytest.mark.parametrize("prefill_instances", [1, 2])
def test_every_request_completes_on_the_decode_pool_with_no_leaked_block(bench_config, prefill_instances):
    metrics, _ = run(bench_config, f"deployment.prefill.instances={prefill_instances}")
    assert metrics["num_completed"] == 16 and metrics["num_failed"] == 0
    stats = metrics["system"]
    assert stats["name"] == "servelab-disaggregated" and stats["num_transfers"] == 16
    prefill, decode = stats["pools"]["prefill"], stats["pools"]["decode"]
    assert prefill["instances"] == prefill_instances and sum(prefill["routed"]) == 16
    assert decode["instances"] == 1 and decode["routed"] == [16]
    assert all(0 < busy <= 1 for busy in prefill["busy_fraction"] + decode["busy_fraction"])
    assert 0 < prefill["utilisation"] < decode["utilisation"] <= 1   # short prompts, longer decodes
    assert stats["transfer_ms"]["p50"] > 0 and stats["transfer_ms"]["p90"] >= stats["transfer_ms"]["p50"]
    assert stats["prefill_queue_ms"]["mean"] >= 0 and stats["decode_queue_ms"]["mean"] >= 0
    assert metrics["ttft_ms"]["p50"] > 0 and metrics["tpot_ms"]["mean"] > 0


def test_pools_take_their_own_hardware_and_split(bench_config):
    metrics, system = run(bench_config, "deployment.link=infiniband",
                          'deployment.decode.overrides=["hardware=h100-80gb","parallel.tensor_parallel_size=2"]')
    decode = metrics["system"]["pools"]["decode"]
    assert (decode["hardware"], decode["tensor_parallel_size"]) == ("h100-80gb", 2)
    assert metrics["system"]["pools"]["prefill"]["hardware"] == "a100-80gb"
    assert metrics["num_completed"] == 16
    # the slower end's figures: A100's HDR port, one stream (the prefill instance has one device)
    assert metrics["system"]["link"] == {"name": "infiniband", "bandwidth": 25.0e9, "latency_s": 20.0e-6, "streams": 1}


def test_transfer_time_grows_with_bytes_and_shrinks_with_a_faster_link(bench_config):
    fast, _ = run(bench_config, "deployment.link=nvlink")
    slow, _ = run(bench_config, "deployment.link=pcie")
    assert slow["system"]["transfer_bytes_mean"] == fast["system"]["transfer_bytes_mean"]
    ratio = slow["system"]["transfer_ms"]["mean"] / fast["system"]["transfer_ms"]["mean"]
    assert 5 < ratio < 300e9 / 32e9 + 0.5    # mostly bytes over bandwidth; the same fixed cost on both
    longer, _ = run(bench_config, "deployment.link=pcie", "workload.input_range=[512,1024]")
    assert longer["system"]["transfer_bytes_mean"] > 3 * slow["system"]["transfer_bytes_mean"]
    assert longer["system"]["transfer_ms"]["mean"] > 3 * slow["system"]["transfer_ms"]["mean"]
    one_byte, _ = run(bench_config, "deployment.link=pcie", "cache.kv_dtype=int8")
    # float16 rows of 128 values (256 bytes) against int8 rows of 128 values and a 4-byte scale
    assert one_byte["system"]["transfer_bytes_mean"] == pytest.approx(
        slow["system"]["transfer_bytes_mean"] * 132 / 256)


def test_a_slower_link_delays_decoding_but_not_the_first_token(bench_config):
    fast, _ = run(bench_config, "deployment.link=nvlink")
    slow, _ = run(bench_config, "deployment.link=pcie", 'deployment.decode.overrides=["hardware.links.pcie.bandwidth=1e9"]')
    assert sorted(slow["samples"]["ttft_ms"]) == pytest.approx(sorted(fast["samples"]["ttft_ms"]))  # prefill's token
    assert slow["tpot_ms"]["mean"] > fast["tpot_ms"]["mean"]
    assert slow["e2e_ms"]["mean"] > fast["e2e_ms"]["mean"] + slow["system"]["transfer_ms"]["mean"] / 2
    assert slow["system"]["transfer_ms"]["mean"] > 50 * fast["system"]["transfer_ms"]["mean"]


def test_a_decode_instance_without_room_makes_transfers_wait(bench_config):
    roomy, _ = run(bench_config, "workload.rate=200")
    tight, _ = run(bench_config, "workload.rate=200", 'deployment.decode.overrides=["cache.num_blocks=80"]')
    assert tight["num_completed"] == 16 and tight["system"]["num_transfers"] == 16
    assert tight["system"]["pools"]["decode"]["kv_peak_usage"][0] > 0.8
    assert tight["system"]["decode_queue_ms"]["p90"] > 2 * roomy["system"]["decode_queue_ms"]["p90"]


def test_capacity_mode_searches_the_deployment(bench_config, tmp_path):
    cfg = bench_config(*BASE, "mode=capacity", "slo.tbt_p99_ms=100000", "mode.rate_low=5", "mode.rate_high=10",
                       "mode.max_iterations=2")
    system = open_system(cfg, str(tmp_path))
    try:
        metrics = measure_capacity(system, cfg)
        assert_nothing_left(system)
    finally:
        system.close()
    assert metrics["capacity"]["capacity_rps"] == 10 and metrics["system"]["num_transfers"] == 16


@pytest.mark.parametrize("overrides, message", [
    (("deployment.link=carrier_pigeon",), "deployment.link='carrier_pigeon': hardware=a100-80gb of deployment.prefill "
                                          "has no such link"),
    (("hardware=local", "deployment.link=nvlink"), "hardware=local of deployment.decode has no such link (it has pcie"),
    (("deployment.prefill.instances=0",), "deployment.prefill.instances must be at least 1, got 0"),
    (("deployment.decode.instances=0",), "deployment.decode.instances must be at least 1, got 0"),
    (("target.replicas=2",), "target.replicas=2 does not combine with deployment=disaggregated"),
    (("executor=model", "model=toy"), "deployment.prefill has executor=model"),
    (("baseline=transformers",), "baseline=transformers runs one engine: use deployment=single"),
])
def test_bad_settings_name_the_field(bench_config, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        open_system(bench_config(*BASE, *overrides), str(tmp_path))


def test_pools_must_store_the_same_blocks(bench_config):
    every = [*BASE, 'deployment.decode.overrides=["cache.block_size=32"]']
    with pytest.raises(ConfigError, match="must store the same KV blocks"):
        DisaggregatedSystem(bench_config(*every), ["model=toy", "use_tqdm=false", *every])


def test_pool_overrides_need_the_apps_overrides(bench_config):
    with pytest.raises(ConfigError, match="recompose the app's config"):
        DisaggregatedSystem(bench_config(*BASE, 'deployment.decode.overrides=["hardware=h100-80gb"]'))


def test_a_sweep_over_links_writes_rows_table_and_plots(tmp_path):
    import json
    import subprocess
    import sys

    sweep = tmp_path / "sweep"
    overrides = [o for o in BASE if not o.startswith("workload.num_requests")]
    result = subprocess.run(
        [sys.executable, "-c", "from servelab.bench.cli import main; main()", "-m", *overrides,
         "workload.num_requests=8", "deployment.link=nvlink,pcie", 'deployment.decode.overrides=["hardware=h100-80gb"]',
         "use_tqdm=false", f"hydra.sweep.dir={sweep}"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = [json.loads((sweep / job / "metrics.json").read_text()) for job in ("0", "1")]
    assert [m["system"]["link"]["name"] for m in jobs] == ["nvlink", "pcie"]
    assert all(m["num_completed"] == 8 and m["simulated"] for m in jobs)
    assert jobs[0]["system"]["pools"]["decode"]["hardware"] == "h100-80gb"
    assert jobs[1]["system"]["transfer_ms"]["mean"] > jobs[0]["system"]["transfer_ms"]["mean"]
    assert "| deployment.link=pcie | servelab-disaggregated |" in (sweep / "results.md").read_text()
    assert (sweep / "throughput_latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_servelab_bench_refuses_real_engines_in_pools(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", "from servelab.bench.cli import main; main()", "model=toy",
                             "deployment=disaggregated"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 2
    assert "deployment=disaggregated in servelab-bench runs simulated pools (executor=simulated)" in result.stderr
