"""The shipped checkpoints are real Hugging Face models and servelab reproduces them."""

from __future__ import annotations

import pathlib

import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.core.config import checkpoint_path
from servelab.testing import assert_engine_matches_transformers

PROMPTS = ["def fibonacci(n):", "import os\n\n\nclass Config:\n", "for i in range(10):"]


@pytest.mark.parametrize("name", ["tiny", "tiny-draft"])
def test_transformers_loads_the_checkpoint_and_servelab_matches_it(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = checkpoint_path(name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.architectures == ["LlamaForCausalLM"] and model.dtype == torch.bfloat16
    assert tokenizer.decode(tokenizer.encode(PROMPTS[1], add_special_tokens=False)) == PROMPTS[1]
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert_engine_matches_transformers(folder, prompts=prompts, max_tokens=16)


def test_default_preset_is_tiny_and_writes_python():
    llm = LLM()
    assert llm.engine.cfg.model.path == checkpoint_path("tiny")
    text = llm.generate("def fibonacci(n):", SamplingParams(temperature=0.0, max_tokens=32),
                        use_tqdm=False)[0].outputs[0].text
    assert text.startswith("\n    ") and "\ufffd" not in text


def test_both_checkpoints_fit_the_size_budget():
    total = sum(f.stat().st_size for name in ("tiny", "tiny-draft")
                for f in pathlib.Path(checkpoint_path(name)).iterdir())
    assert total <= 12 * 1024 * 1024
