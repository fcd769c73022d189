"""servelab-bench with LoRA adapters: ``workload.adapters`` spreads the requests over
them, and ``system.lora`` reports the slots' paging during the measured requests."""

from __future__ import annotations

import pytest
import torch

from servelab.testing import tiny_checkpoint

pytest.importorskip("peft")


def test_requests_spread_over_adapters_and_paging_is_reported(tmp_path, bench_config):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from servelab.bench.report import summary_table
    from servelab.bench.runner import measure
    from servelab.bench.targets.inproc import ServelabSystem
    from servelab.bench.workload import TokenSpace, build_workload

    base = tiny_checkpoint(tmp_path / "base")
    for seed, name in enumerate("ab"):
        torch.manual_seed(seed)
        get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
            r=2, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(tmp_path / name)
    cfg = bench_config("model=local", f"model.path={base}", "model.dtype=float32", "device=cpu",
                       f"lora.adapters={{a: '{tmp_path / 'a'}', b: '{tmp_path / 'b'}'}}", "lora.max_adapters=1",
                       "lora.admission=false", "workload.adapters=[a,b]", "workload.num_requests=6",
                       "workload.input_range=[8,8]",
                       "workload.output_range=[4,4]", "warmup_requests=1")
    space = TokenSpace(257, 256, None)
    drawn = [r.lora for r in build_workload(cfg.workload, space)]
    assert set(drawn) == {"a", "b"} and drawn == [r.lora for r in build_workload(cfg.workload, space)]
    system = ServelabSystem(cfg)
    try:
        metrics = measure(system, cfg)
    finally:
        system.close()
    lora = metrics["system"]["lora"]
    assert metrics["num_failed"] == 0 and lora["loads"] >= 2 and lora["split_steps"] > 0 and lora["load_ms"] > 0
    assert 0 < lora["hit_rate"] < 1
    assert "adapter hit %" in summary_table(metrics)
