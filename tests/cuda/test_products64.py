"""flared's Hopper product kernel (kernels/products64.py) against torch, and the decode step that runs its
products through it (PagedCudaDecoder.p64_batches) against the same step through cuBLAS.

The kernel sums in its own order, so products agree with torch to bfloat16 rounding; the SwiGLU epilogue
rounds gate, up and silu(gate) as fused.silu_mul does, and the residual epilogue adds as fused.add_rms_norm
does (the folded RMSNorm rounds h * weight once, so it agrees with add_rms_norm to bfloat16 rounding). A captured
graph must replay the step exactly.
"""

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")


def _skip_unless_hopper():
    from flared.model.kernels import products64

    if not products64.available():
        pytest.skip("products64 needs an sm_90 GPU and CuPy")


@pytest.mark.parametrize("n, k, epi, rows", [
    (6144, 4096, False, 64),  # Llama-3.1-8B's qkv, o, gate_up and down
    (4096, 4096, False, 40),  # fewer rows than the matrix unit's 64: the rest read zeros, write nothing
    (28672, 4096, True, 64),
    (4096, 14336, False, 64),
    (960, 576, False, 33),  # SmolLM2-135M's widths: 64-column stages, 8-row tiles
    (3072, 576, True, 1),
    (576, 1536, False, 64),
])
def test_products_match_torch(n, k, epi, rows):
    from flared.model.kernels import products64
    from flared.model.kernels.fused import silu_mul

    _skip_unless_hopper()
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (0.02 * torch.randn(n, k, device="cuda", generator=g)).to(torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    build = products64.plan(n, k, epi, torch.cuda.get_device_properties(0).multi_processor_count)
    prod = products64.Products64(n, k, build)
    ref = torch.nn.functional.linear(x, w)
    if epi:
        act = torch.empty(rows, n // 2, device="cuda", dtype=torch.bfloat16)
        silu_mul(ref, act)
        ref = act
    # a row past ``rows`` in the output buffer stays as it was
    out = torch.full((rows + 1, prod.out_cols), 7.0, device="cuda", dtype=torch.bfloat16)
    prod(prod.weight_map(w), prod.input_map(x), out, rows=rows)
    torch.cuda.synchronize()
    scale = ref.float().abs().max().item()
    assert (out[:rows].float() - ref.float()).abs().max().item() <= 0.01 * scale, build
    assert torch.all(out[rows] == 7.0)


@pytest.mark.parametrize("n, k, rows", [
    (4096, 4096, 64),  # Llama-3.1-8B's o and down into the residual stream
    (4096, 14336, 40),
    (576, 1536, 33),  # SmolLM2-135M's down
])
def test_residual_epilogue_adds_into_h_and_leaves_h_times_the_norm_weight_and_each_rows_sum_of_squares(n, k, rows):
    from flared.model.kernels import products64
    from flared.model.kernels.fused import add_rms_norm

    _skip_unless_hopper()
    g = torch.Generator(device="cuda").manual_seed(n + k + 1)
    w = (0.02 * torch.randn(n, k, device="cuda", generator=g)).to(torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    h = torch.randn(rows + 1, n, device="cuda", generator=g).to(torch.bfloat16)
    build = replace(products64.plan(n, k, False, torch.cuda.get_device_properties(0).multi_processor_count), epi=2)
    prod = products64.Products64(n, k, build)
    ref_h, normed = h.clone(), torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    add_rms_norm(torch.nn.functional.linear(x, w), ref_h[:rows], torch.ones(n, device="cuda", dtype=torch.bfloat16),
                 normed, 1e-5)
    got_h = h.clone()
    norm_w = (1 + 0.2 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16)
    xw = torch.full_like(h, 7.0)
    partials = torch.full((prod.blocks, products64.ROWS), float("nan"), device="cuda")
    prod(prod.weight_map(w), prod.input_map(x), got_h, rows=rows, part_out=partials, norm_weight=norm_w, xw_out=xw)
    torch.cuda.synchronize()
    assert (got_h[:rows].float() - ref_h[:rows].float()).abs().max().item() <= 0.02 * ref_h.float().abs().max().item()
    assert torch.equal(got_h[rows], h[rows])  # a row past ``rows`` stays as it was
    assert torch.equal(xw[:rows], (got_h[:rows].float() * norm_w.float()).to(torch.bfloat16))
    assert torch.all(xw[rows] == 7.0)
    sums = partials[:, :rows].sum(0)
    assert torch.allclose(sums, got_h[:rows].float().pow(2).sum(1), rtol=1e-4)


@pytest.mark.parametrize("n, k, epi, rows", [
    (6144, 4096, False, 64),  # Llama-3.1-8B's qkv and gate_up (two 64-column boxes a stage; the SwiGLU epilogue)
    (28672, 4096, True, 64),
    (960, 576, False, 33),  # SmolLM2-135M's
    (3072, 576, True, 1),
])
def test_normed_rows_match_add_rms_norm_then_the_product(n, k, epi, rows):
    from flared.model.kernels import products64
    from flared.model.kernels.fused import add_rms_norm, silu_mul

    _skip_unless_hopper()
    eps = 1e-5
    g = torch.Generator(device="cuda").manual_seed(n + k + 2)
    w = (0.02 * torch.randn(n, k, device="cuda", generator=g)).to(torch.bfloat16)
    h = (3 * torch.randn(rows, k, device="cuda", generator=g)).to(torch.bfloat16)
    norm_w = (1 + 0.2 * torch.randn(k, device="cuda", generator=g)).to(torch.bfloat16)
    x = torch.empty_like(h)
    add_rms_norm(None, h.clone(), norm_w, x, eps)
    ref = torch.nn.functional.linear(x, w)
    build = replace(products64.plan(n, k, epi, torch.cuda.get_device_properties(0).multi_processor_count), norm=1)
    prod = products64.Products64(n, k, build)
    if epi:
        act = torch.empty(rows, n // 2, device="cuda", dtype=torch.bfloat16)
        silu_mul(ref, act)
        ref = act
    # the rows' sums of squares in three parts (over column thirds), as three residual tiles would leave them
    partials = torch.zeros(3, products64.ROWS, device="cuda")
    for part, cols in enumerate(h.float().pow(2).tensor_split(3, dim=1)):
        partials[part, :rows] = cols.sum(1)
    out = torch.full((rows, prod.out_cols), 7.0, device="cuda", dtype=torch.bfloat16)
    xw = (h.float() * norm_w.float()).to(torch.bfloat16)  # as the residual epilogue leaves it
    prod(prod.weight_map(w), prod.input_map(xw), out, part_in=partials, nparts=3, eps=eps)
    torch.cuda.synchronize()
    assert (out.float() - ref.float()).abs().max().item() <= 0.01 * ref.float().abs().max().item(), build


@pytest.mark.parametrize("batch, tiled, fold, pdl, attn_pdl", [
    (64, False, False, False, False),
    (32, False, False, False, False),
    (64, True, False, False, False),
    (64, False, True, False, False),  # the add_rms_norm launches folded into the products
    (64, False, False, True, False),  # programmatic dependent launches
    (64, False, True, True, False),
    (32, False, True, True, False),
    (64, False, True, True, True),  # the attention between qkv and o too
])
def test_decode_step_through_products64_matches_cublas_and_replays_exactly(batch, tiled, fold, pdl, attn_pdl):
    from flared.execution.graphs import time_graph_us
    from test_blas_lt import _decoder
    from test_megakernel import _step

    _skip_unless_hopper()
    g = torch.Generator().manual_seed(batch)
    contexts = torch.randint(1, 400, (batch,), generator=g).tolist()
    contexts[3] = 0  # a padding row
    model, dec = _decoder(batch, contexts)
    assert batch in dec.p64_candidates
    dec.p64_tiled = tiled  # tile-by-tile weight copies for qkv, o and down
    dec.p64_fold, dec.p64_pdl, dec.attn_pdl = fold, pdl, attn_pdl
    assert all(p.build.wtiled == (tiled and name != "gate_up") for name, p in dec.products().products.items())
    dec.p64_batches = set()
    ref, ref_k, ref_v = _step(dec, batch, mega=False)
    dec.p64_batches = {batch}
    got, k, v = _step(dec, batch, mega=False)
    live = [r for r, c in enumerate(contexts) if c > 0]
    scale = ref[live].abs().max().item()
    assert (got[live] - ref[live]).abs().max().item() <= 0.03 * scale
    assert torch.nn.functional.cosine_similarity(got[live], ref[live], dim=-1).min().item() > 0.999
    # the K/V the step writes, to bfloat16 rounding of the qkv product
    assert (k.float() - ref_k.float()).abs().max().item() < 0.05
    assert (v.float() - ref_v.float()).abs().max().item() < 0.05
    # captured and replayed: the eager products64 step's logits exactly
    time_graph_us(lambda: dec.decode(batch, False), torch.cuda.Stream(), replays=3)
    torch.cuda.synchronize()
    assert torch.equal(dec.logits[live], got[live])


def test_calibration_times_products64_per_batch():
    from flared.execution.graphs import time_graph_us
    from test_blas_lt import _decoder

    _skip_unless_hopper()
    model, dec = _decoder(64, [0] * 64)  # padding inputs, as GraphSet calibrates
    dec._calibrate_p64(torch.cuda.Stream(), time_graph_us)
    cal = dec.calibration
    assert "products64_error" not in cal
    assert set(cal["p64_us"]) == {32, 64} and set(cal["p64_other_us"]) == {32, 64}
    assert cal["p64_batches"] == sorted(dec.p64_batches)
    assert all((b in dec.p64_batches) == (cal["p64_us"][b] <= 0.99 * cal["p64_other_us"][b]) for b in (32, 64))


def test_unsupported_models_say_why():
    from flared.model.kernels import products64
    from test_megakernel import _hf, _serving

    _skip_unless_hopper()
    assert products64.unsupported(_serving(_hf("qwen2").to("cuda"), torch.bfloat16)) == "projection biases"
    assert products64.unsupported(_serving(_hf("llama64").to("cuda"), torch.float32)) == "the kernel multiplies bf16"
