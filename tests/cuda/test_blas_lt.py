"""Large decode batches through cuBLASLt (PagedCudaDecoder.lt_batches) against the same step through cuBLAS.

Different BLAS libraries sum in different orders, so the logits agree to bfloat16 rounding, not bit for bit;
a captured graph must replay the cuBLASLt step exactly, and the process-wide library choice must be back to
what it was after every step.
"""

import pytest

torch = pytest.importorskip("torch")


def _decoder(batch, contexts):
    from test_megakernel import _decoder as build

    model, dec = build("llama64", batch, contexts)
    dec.mega_max_rows = 0
    dec.skinny_max_rows = 0
    return model, dec


def _run(dec, batch):
    k0, v0 = dec.k_pool.clone(), dec.v_pool.clone()
    dec.decode(batch, False)
    torch.cuda.synchronize()
    logits = dec.logits[:batch].clone()
    dec.k_pool.copy_(k0)
    dec.v_pool.copy_(v0)
    return logits


def test_cublaslt_step_matches_cublas_and_replays_exactly():
    from flared.execution.graphs import time_graph_us

    g = torch.Generator().manual_seed(5)
    contexts = torch.randint(1, 400, (32,), generator=g).tolist()
    model, dec = _decoder(32, contexts)
    assert dec.lt_candidates == [32]
    library = torch.backends.cuda.preferred_blas_library()
    dec.lt_batches = set()
    ref = _run(dec, 32)
    dec.lt_batches = {32}
    got = _run(dec, 32)
    assert torch.backends.cuda.preferred_blas_library() == library
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 0.03 * scale
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min().item() > 0.999
    # captured with cuBLASLt and replayed: the eager cuBLASLt step's logits exactly
    time_graph_us(lambda: dec.decode(32, False), torch.cuda.Stream(), replays=3)
    torch.cuda.synchronize()
    assert torch.equal(dec.logits[:32], got)
    assert torch.backends.cuda.preferred_blas_library() == library


def test_calibration_times_cublaslt_per_batch():
    from flared.execution.graphs import time_graph_us

    model, dec = _decoder(32, [0] * 32)  # padding inputs, as GraphSet calibrates
    dec.lt_batches = set()
    dec._calibrate_lt(torch.cuda.Stream(), time_graph_us)
    cal = dec.calibration
    assert set(cal["lt_us"]) == {32} and set(cal["blas_us"]) == {32}
    assert dec.lt_batches == ({32} if cal["lt_us"][32] <= 0.99 * cal["blas_us"][32] else set())
    assert cal["lt_batches"] == sorted(dec.lt_batches)


def test_float32_never_uses_cublaslt():
    from gpu_models import serving_model, tiny_hf
    from flared.model.kernels.paged_decoder import PagedCudaDecoder
    from test_megakernel import _decoder as build

    _, bf16_dec = build("llama64", 32, [1] * 32)
    model = serving_model(tiny_hf(), dtype=torch.float32)
    dec = PagedCudaDecoder(model, bf16_dec.inputs, num_pages=64, page_tokens=16, num_state_rows=33, max_batch=32,
                           max_tokens=32)
    assert dec.lt_candidates == [] and dec.lt_batches == set()
