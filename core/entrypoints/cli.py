"""Console entry point ``servelab``: offline completion of prompts from the command line."""

from __future__ import annotations

import sys

from omegaconf import DictConfig, OmegaConf

from servelab.core.entrypoints.compose import prepare_hydra


def _prompts(cfg: DictConfig) -> list[str]:
    prompts = list(cfg.prompts)
    if cfg.prompt is not None:
        prompts.insert(0, cfg.prompt)
    if cfg.prompts_file:
        with open(cfg.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    return prompts or ["def fibonacci(n):"]


def run(cfg: DictConfig) -> None:
    """Build the engine from ``cfg``, complete its prompts, print them and a summary;
    configuration and request errors exit with status 2 and a one-paragraph message."""
    from servelab.core.errors import ConfigError, InvalidRequestError

    try:
        complete(cfg)
    except (ConfigError, InvalidRequestError) as exc:
        print(f"servelab: error: {exc}", file=sys.stderr)
        sys.exit(2)


def complete(cfg: DictConfig) -> None:
    """Complete the configured prompts and print them with a throughput summary."""
    from servelab.core.entrypoints.llm import LLM
    from servelab.core.sampling_params import SamplingParams

    llm = LLM.from_config(cfg)
    params = SamplingParams(**OmegaConf.to_container(cfg.sampling))
    prompts = _prompts(cfg)
    clock = llm.engine.clock
    started = clock.now()
    outputs = llm.generate(prompts, params, use_tqdm=cfg.use_tqdm, lora=cfg.adapter)
    elapsed = clock.now() - started
    generated = 0
    for output in outputs:
        for completion in output.outputs:
            generated += len(completion.token_ids)
            print(f"=== prompt: {output.prompt!r} (finish: {completion.finish_reason})")
            print(output.prompt + completion.text)
    ttfts = [o.metrics.ttft for o in outputs if o.metrics.ttft is not None]
    mean_ttft = 1000 * sum(ttfts) / len(ttfts) if ttfts else float("nan")
    print(f"--- {len(outputs)} prompts, {generated} tokens in {elapsed:.2f}s "
          f"({generated / elapsed:.1f} tok/s), mean TTFT {mean_ttft:.1f} ms")


def main() -> None:
    """``servelab [overrides...]``: Hydra app over ``conf/config.yaml``."""
    import hydra

    prepare_hydra()
    hydra.main(config_path="pkg://servelab.conf", config_name="config", version_base=None)(run)()
