"""The CPU linear layer: float32 weights in the blocked layout, bfloat16 ones prepacked for
oneDNN with row buckets and kernel warm-up."""

import pytest
import torch
import torch.nn.functional as F

from servelab.kernels.cpu_ops import native_cpu_available, native_cpu_enabled
from servelab.plugins.models.linear import (BLOCKED_BFLOAT16_ROWS, Linear, bfloat16_matmul_supported, is_blocked, linear_input, padded_rows,
                                           pads_rows, release_padding_buffers, warm_up_linears)

packing = pytest.mark.skipif(not (native_cpu_enabled() and torch.backends.mkldnn.is_available()),
                             reason="the prepacked oneDNN path is off here")
blocked = pytest.mark.skipif(not native_cpu_available(), reason="the native CPU ops are unavailable here")
bfloat16_rows_in_place = pytest.mark.skipif(not (native_cpu_enabled() and bfloat16_matmul_supported()),
                                            reason="no bfloat16 oneDNN matmul here: bfloat16 rows go through float32")


def onednn_buckets(max_rows: int) -> set[int]:
    """The row buckets up to ``max_rows`` that a bfloat16 ``Linear`` multiplies with oneDNN
    (fewer rows take ``bf16_linear`` where the native ops are built)."""
    smallest = BLOCKED_BFLOAT16_ROWS + 1 if native_cpu_available() else 1
    return {padded_rows(rows) for rows in range(smallest, max_rows + 1)}


def test_row_buckets_are_few_and_waste_little():
    buckets = {padded_rows(rows) for rows in range(1, 8193)}
    assert len(buckets) <= 80
    for rows in range(1, 8193):
        padded = padded_rows(rows)
        assert padded >= rows
        assert padded == rows or rows > 16
        if rows > 128:
            assert padded <= rows * 1.125, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 17, 130, 300])
def test_packed_linear_matches_f_linear(dtype, rows):
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True).to(dtype)
    x = torch.randn(rows, 64, dtype=dtype)
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == (rows, 48) and out.is_contiguous()
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    if native_cpu_available():
        assert is_blocked(layer._packed[1]) == (dtype == torch.float32)


def test_packed_linear_keeps_leading_dims_and_follows_weight_updates():
    torch.manual_seed(0)
    layer = Linear(32, 16, bias=False)
    x = torch.randn(3, 19, 32)
    with torch.inference_mode():
        first = layer(x)
    assert first.shape == (3, 19, 16)
    with torch.no_grad():
        layer.weight.mul_(2)
    with torch.inference_mode():
        second = layer(x)
    torch.testing.assert_close(second, 2 * first, atol=1e-4, rtol=1e-4)


@packing
def test_warm_up_visits_each_distinct_onednn_shape_once_per_bucket():
    model = torch.nn.Sequential(Linear(32, 64), Linear(32, 64), Linear(64, 32)).to(torch.bfloat16)
    buckets = onednn_buckets(40)
    assert warm_up_linears(model, 40) == 2 * len(buckets)
    assert warm_up_linears(model, 0) == 0


@blocked
def test_warm_up_packs_float32_layers_and_compiles_nothing_for_them():
    """float32 layers multiply any row count without padding (what the step profiler
    records as the row buckets) and need no kernel compiled ahead."""
    model = torch.nn.Sequential(Linear(32, 64), Linear(64, 32))
    assert warm_up_linears(model, 40) == 0
    assert all(is_blocked(layer._packed[1]) for layer in model)
    assert not pads_rows(torch.float32) and pads_rows(torch.bfloat16) == torch.backends.mkldnn.is_available()


@packing
def test_padded_rows_are_independent_of_what_the_reused_buffer_held():
    """Row counts between buckets share one padding buffer per width: a smaller batch after
    a larger one (stale NaN rows below it) still gets exactly its own rows' products, in
    and out of inference mode."""
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=False).to(torch.bfloat16)
    small = torch.randn(130, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        clean = layer(small)
        layer(torch.full((300, 64), float("nan"), dtype=torch.bfloat16))
        after_nan = layer(small)
    with torch.no_grad():
        outside = layer(small)
    assert torch.isfinite(after_nan).all()
    assert torch.equal(after_nan, clean) and torch.equal(outside, clean)
    torch.testing.assert_close(clean.float(), F.linear(small.float(), layer.weight.float()), atol=5e-2, rtol=5e-2)


@bfloat16_rows_in_place
def test_rows_with_room_in_their_memory_are_multiplied_without_a_copy(monkeypatch):
    """An input whose memory already holds the padded row count (``linear_input``, or a
    matmul's output sliced to its real rows) is multiplied in place: NaN in the rows past
    it changes nothing, and the padding buffer is not touched. Other inputs still pad."""
    from servelab.plugins.models import linear as layers

    torch.manual_seed(0)
    layer, first = Linear(64, 48, bias=False).to(torch.bfloat16), Linear(64, 64, bias=False).to(torch.bfloat16)
    small = torch.randn(130, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = layer(small)
        chained = layer(first(small).clone())
        hidden = first(small)  # a matmul's output sliced to its 130 rows
        x = linear_input(130, 64, small)
        assert not x.as_strided((padded_rows(130), 64), (64, 1))[130:].any()  # zeros, not leftovers
        x.copy_(small)
        x.as_strided((padded_rows(130), 64), (64, 1))[130:] = float("nan")

        def no_copy(*args):
            raise AssertionError("copied into the padding buffer")

        monkeypatch.setattr(layers, "_padding_buffer", no_copy)
        assert torch.equal(layer(x), expected)
        assert torch.equal(layer(hidden), chained)
        for other in (small.t().contiguous().t(), torch.cat([small, small])[:130]):  # strided; other memory
            with pytest.raises(AssertionError, match="copied"):
                layer(other)
        monkeypatch.undo()
        assert torch.equal(layer(torch.cat([small, small])[:130]), expected)


@packing
@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_without_native_matmuls_multiplies_in_float32(monkeypatch, native):
    """Where oneDNN has no bfloat16 matmul the weight is packed in float32 and the layer
    still takes and returns bfloat16: the float32 product of the same bfloat16 values,
    rounded once (up to summation order), with the bias and leading dims kept."""
    from servelab.plugins.models import linear as layers

    if native and not layers.bfloat16_matmul_supported():
        pytest.skip("this CPU has no bfloat16 matmul instructions")
    monkeypatch.setattr(layers, "bfloat16_matmul_supported", lambda: native)
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(2, 65, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = layer(x)
    assert layer._packed[1].dtype == (torch.bfloat16 if native else torch.float32)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 65, 48)
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    one_ulp = expected.abs() * 2 ** -7 + 1e-6
    assert ((out.float() - expected).abs() <= one_ulp).all()
    if not native:
        assert (out == expected.bfloat16()).float().mean() > 0.99


@packing
def test_llm_warm_up_compiles_every_bucket_and_generation_is_unchanged(llama):
    """``LLM.warm_up(n)`` multiplies through each distinct oneDNN-packed linear shape of the
    model at every row bucket up to n that oneDNN multiplies (the LM head included), leaves
    the outputs as they were, and names a bad argument."""
    from servelab import LLM, SamplingParams

    llm = LLM(llama, overrides=["model.dtype=bfloat16", "device=cpu"])
    params = SamplingParams(temperature=0.0, max_tokens=6)
    before = llm.generate("hello world", params, use_tqdm=False)[0].outputs[0].token_ids
    model = llm.engine.executor.model
    shapes = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, Linear)}
    buckets = onednn_buckets(64)
    assert llm.warm_up(64) == len(shapes) * len(buckets)
    assert llm.generate("hello world", params, use_tqdm=False)[0].outputs[0].token_ids == before
    with pytest.raises(ValueError, match="max_tokens must be 0 or more"):
        llm.warm_up(-1)


@packing
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_warm_up_defaults_to_the_step_budget_and_packs_every_layer(llama, monkeypatch, dtype):
    """``LLM.warm_up()`` covers every step the scheduler can form (its token budget) and
    packs the weight of every linear layer, so serving afterwards neither packs nor meets
    a new step size (float32 layers, in the blocked layout, compile no kernels); each
    built-in scheduler reports its budget."""
    from servelab import LLM, SamplingParams
    from servelab.plugins.models import linear as layers

    llm = LLM(llama, overrides=[f"model.dtype={dtype}", "device=cpu", "scheduler=chunked", "scheduler.token_budget=96"])
    assert llm.engine.max_step_tokens == 96
    model = llm.engine.executor.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    shapes = {(m.in_features, m.out_features) for m in linears}
    buckets = onednn_buckets(96)
    blocked_layers = dtype == "float32" and native_cpu_available()
    assert llm.warm_up() == (0 if blocked_layers else len(shapes) * len(buckets))
    assert len(linears) > len(shapes)  # layers sharing a shape are packed too
    assert all(m._packed is not None and m._packed[1] is not None for m in linears)
    assert all(is_blocked(m._packed[1]) == blocked_layers for m in linears)
    assert all((m._blocked.copy is not None) == (dtype == "bfloat16" and native_cpu_available()) for m in linears)

    def no_packing(weight):
        raise AssertionError("a weight was packed after warm_up")

    monkeypatch.setattr(layers, "_pack", no_packing)
    out = llm.generate(["hello world", "a longer prompt for the step"], SamplingParams(temperature=0.0, max_tokens=4),
                       use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)

    budgets = {"continuous": 2048, "static": 8192, "dynamic": 8192}
    for scheduler, budget in budgets.items():
        engine = LLM(llama, overrides=["model.dtype=float32", "device=cpu", f"scheduler={scheduler}"]).engine
        assert engine.max_step_tokens == budget


@packing
def test_padding_buffers_are_released_on_demand():
    layer = Linear(64, 48, bias=False).to(torch.bfloat16)
    x = torch.randn(padded_rows(17) - 1, 64, dtype=torch.bfloat16)  # a row count that is padded
    with torch.inference_mode():
        first = layer(x)
    assert release_padding_buffers() >= padded_rows(17) * 64 * 2
    assert release_padding_buffers() == 0
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), first)  # a new buffer, the same result
