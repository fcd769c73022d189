"""Simulated mixture-of-experts serving against published measurements
(docs/results/simulated_moe.md): each setup's step priced by the roofline with the experts
routed (``cost_model/experts.py``) and, for comparison, as the dense MLP as wide as the
experts a token passes that servelab priced before. Prints a markdown table.

    python benchmarks/moe_validation.py
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from servelab.core.cost_model import BatchShape
from servelab.core.engine.llm_engine import LLMEngine
from servelab.core.entrypoints.compose import compose_config
from servelab.plugins.cost_model.roofline import RooflineCostModel


@dataclass(frozen=True)
class Setup:
    """A published measurement: ``overrides`` for the engine, ``metric`` and its
    ``published`` value, and what a decode step holds (``sequences`` in flight, each with
    ``context`` tokens, over ``nodes`` nodes) or, for ``ttft_ms``, the prompt length."""

    name: str
    overrides: tuple[str, ...]
    metric: str
    published: float
    source: str
    sequences: int = 1
    context: int = 512
    nodes: int = 1


SETUPS = (
    Setup("Mixtral-8x7B int8, 1 A100-80GB, 1 request, 512 in / 128 out (TensorRT-LLM)",
          ("model=mixtral-8x7b", "hardware=a100-80gb", "model.quantization=int8"), "ttft_ms", 127.0,
          "https://www.baseten.co/blog/faster-mixtral-inference-with-tensorrt-llm-and-quantization/"),
    Setup("Mixtral-8x7B int8, 1 A100-80GB, 1 request, 512 in / 128 out (TensorRT-LLM)",
          ("model=mixtral-8x7b", "hardware=a100-80gb", "model.quantization=int8"), "output_tok_s", 81.0,
          "https://www.baseten.co/blog/faster-mixtral-inference-with-tensorrt-llm-and-quantization/",
          context=512 + 64),
    Setup("DeepSeek-V3 decode, H800 nodes, ~88 sequences/GPU at 4,989 tokens of KV (DeepSeek online service)",
          ("model=deepseek-v3", "hardware=h100-80gb", "model.quantization=int8", "parallel.tensor_parallel_size=8",
           "parallel.expert_parallel_size=8", "parallel.pipeline_parallel_size=2"), "output_tok_s_per_node", 14800.0,
          "https://github.com/deepseek-ai/open-infra-index/blob/main/202502OpenSourceWeek/"
          "day_6_one_more_thing_deepseekV3R1_inference_system_overview.md",
          sequences=2 * 705, context=4989, nodes=2),
    Setup("DeepSeek-V3 decode, H100 nodes, 256 sequences/GPU, 2,000-token prompts (SGLang, PD + EP72)",
          ("model=deepseek-v3", "hardware=h100-80gb", "model.quantization=int8", "parallel.tensor_parallel_size=8",
           "parallel.expert_parallel_size=8", "parallel.pipeline_parallel_size=2"), "output_tok_s_per_node", 22300.0,
          "https://lmsys.org/blog/2025-05-05-large-scale-ep/", sequences=2 * 2048, context=2050, nodes=2),
)


def dense_approximation(cost_model: RooflineCostModel) -> RooflineCostModel:
    """The same cost model with every layer's MLP a dense one as wide as the experts a
    token passes (routed and shared): what servelab priced before it routed experts."""
    shape = cost_model.context.model
    moe = shape.experts
    dense = replace(shape, experts=None, intermediate_size=moe.top_k * moe.expert_intermediate_size
                    + moe.shared_intermediate_size)
    return RooflineCostModel(cost_model.config, replace(cost_model.context, model=dense))


def simulated(setup: Setup, cost_model: RooflineCostModel) -> float:
    """The setup's metric priced by ``cost_model``: a prefill's time, or decode tokens per
    second (per node) with the sequences split over the pipeline's stages in flight."""
    if setup.metric == "ttft_ms":
        return 1e3 * cost_model.forward_cost(BatchShape((setup.context,), (setup.context,), 1)).total
    micro = setup.sequences // cost_model.pp  # one batch in flight per pipeline stage
    cost = cost_model.forward_cost(BatchShape((1,) * micro, (setup.context,) * micro, micro))
    return micro / max(cost.stage_times) / setup.nodes


def main() -> None:
    """Print the comparison table."""
    print("| setup | metric | published | simulated, experts routed | error | dense approximation | error |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for setup in SETUPS:
        engine = LLMEngine(compose_config(["executor=simulated", "cost_model=roofline", "model.max_model_len=8192",
                                           *setup.overrides]))
        moe = simulated(setup, engine.executor.cost_model)
        dense = simulated(setup, dense_approximation(engine.executor.cost_model))
        errors = [f"{100 * (value / setup.published - 1):+.0f}%" for value in (moe, dense)]
        print(f"| {setup.name} | {setup.metric} | {setup.published:,.0f} | {moe:,.0f} | {errors[0]} | "
              f"{dense:,.0f} | {errors[1]} |")


if __name__ == "__main__":
    main()
