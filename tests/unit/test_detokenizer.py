"""Incremental text equals a full decode, including a sequence cut inside a character."""

from __future__ import annotations

from servelab import LLM, SamplingParams
from servelab.core.detokenizer import IncrementalDetokenizer
from servelab.checkpoints.toy import byte_level_tokenizer


def test_incremental_text_plus_flush_equals_full_decode():
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("héllo wörld ✓ done", add_special_tokens=False)
    cut = ids[:-2]  # ends inside the 3-byte check mark
    detokenizer = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detokenizer.add(t) for t in cut)
    assert "\ufffd" not in streamed
    streamed += detokenizer.flush()
    assert streamed == tokenizer.decode(cut) and detokenizer.flush() == ""


def test_streamed_and_final_text_agree():
    llm = LLM("toy", overrides=["device=cpu"])
    params = SamplingParams(temperature=0.0, max_tokens=25)
    final = llm.generate(["abc", "xyz"], params, use_tqdm=False)
    engine = llm.engine
    ids = [engine.add_request(p, params, output_kind="delta") for p in ("abc", "xyz")]
    text = dict.fromkeys(ids, "")
    while engine.has_unfinished_requests():
        for out in engine.step():
            text[out.request_id] += out.outputs[0].text
    assert [text[i] for i in ids] == [o.outputs[0].text for o in final]
