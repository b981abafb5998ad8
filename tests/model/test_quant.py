"""Q8_0 and Q4_1 weights kept quantised on the CPU (flared/model/quant.py, flared/_fast/qlinear_kernel.h): the
formats, the kernels' paths against the bf16 kernel and float64, and a quantised DecoderModel against the bf16 model
whose weights are the dequantised ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flared.model.batch import ForwardBatch, SequenceChunk
from flared.model.quant import (HEAD_QUANTIZATION, check_quantization, dequantize_q4_1, dequantize_q8_0, pack_q4_1,
                                pack_q8_0, q4_1_rows, q8_0_rows, quantize_q4_1, quantize_q8_0)
from .conftest import build_hf_checkpoint

linear = pytest.importorskip("flared._fast.linear")
needs_kernels = pytest.mark.skipif(not linear.BF16_SUPPORTED, reason="this CPU has neither AVX-512 BF16 nor AVX2")
# Each format's (quantize, dequantize, pack, rows, bytes a weight)
FORMATS = {"q8_0": (quantize_q8_0, dequantize_q8_0, pack_q8_0, q8_0_rows, 1.125),
           "q4_1": (quantize_q4_1, dequantize_q4_1, pack_q4_1, q4_1_rows, 0.625)}


def _quantise(fmt: str, weight: torch.Tensor):
    """(the packed tensors, the dequantised bf16 weight, the same in float64) of ``weight`` in format ``fmt``."""
    quantize, dequantize, pack, _, _ = FORMATS[fmt]
    params = quantize(weight)
    return pack(*params), dequantize(*params), dequantize(*params, torch.float64)


def test_the_format_round_trips_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 96, generator=g) * torch.logspace(-3, 1, 96)  # (blocks of very different magnitudes)
    w[3, 32:64] = 0  # an all-zero block: scale 0, values 0
    q, scales = quantize_q8_0(w)
    assert q.dtype == torch.int8 and scales.shape == (70, 3) and int(q.abs().max()) == 127
    assert scales[3, 1] == 0 and not q[3, 32:64].any()
    back = dequantize_q8_0(q, scales, torch.float32)
    step = scales.repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-7).all()
    packed, packed_scales = pack_q8_0(q, scales)
    assert packed.shape == (2, 48, 64, 2) and packed_scales.shape == (2, 3, 64)  # (70 features: 2 groups of 64)
    assert torch.equal(q8_0_rows(packed, packed_scales, list(range(70)), torch.float32), back)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.zeros(4, 48))


def test_the_q4_1_format_round_trips_within_half_a_step():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(70, 96, generator=g) * torch.logspace(-3, 1, 96) + 0.1
    w[3, 32:64] = 0  # a constant block: step 0, values 0, the offset the constant
    w[4, 0:32] = -0.75
    q, steps, offsets = quantize_q4_1(w)
    assert q.dtype == torch.uint8 and steps.dtype == offsets.dtype == torch.float16 and steps.shape == (70, 3)
    assert int(q.max()) == 15 and int(q.min()) == 0
    assert steps[3, 1] == 0 and not q[3, 32:64].any() and offsets[3, 1] == 0 and offsets[4, 0] == -0.75
    back = dequantize_q4_1(q, steps, offsets, torch.float32)
    step = steps.float().repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= 0.52 * step + 1e-6).all()  # (half a step, plus the float16 rounding of both)
    packed, packed_steps, packed_offsets = pack_q4_1(q, steps, offsets)
    assert packed.shape == (2, 24, 128) and packed.dtype == torch.uint8 and packed_steps.shape == (2, 3, 64)
    assert torch.equal(q4_1_rows(packed, packed_steps, packed_offsets, list(range(70)), torch.float32), back)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q4_1(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="float16"):
        quantize_q4_1(torch.full((1, 32), 1e6) * torch.arange(32))


def test_a_bf16_weight_made_of_q4_1_blocks_quantises_back_to_them():
    """A bf16 model exported from a Q4_1 GGUF (the embedded SmolLM2) holds fma(d, q, m) in bf16: its blocks come back
    with the same values, and their weights within bf16's rounding of it."""
    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (64, 128), generator=g, dtype=torch.uint8)
    q[:, ::32], q[:, 1::32] = 0, 15  # (each block spans the whole range, as Q4_1's quantiser makes it)
    steps = (torch.rand(64, 4, generator=g) * 0.01 + 1e-3).half()
    offsets = (-torch.rand(64, 4, generator=g) * 0.05).half()
    weight = dequantize_q4_1(q, steps, offsets)
    q2, steps2, offsets2 = quantize_q4_1(weight)
    assert torch.equal(q2, q)
    again = dequantize_q4_1(q2, steps2, offsets2, torch.float32)
    # (the block's ends were rounded to bf16, so its step and offset may move by that: a few bf16 steps of its
    # largest value, against the 1/15 of its range that one value's step is)
    largest = weight.float().abs().reshape(64, 4, 32).amax(dim=-1).repeat_interleave(32, dim=1)
    assert ((again - weight.float()).abs() <= largest * 2 ** -7).all()


@pytest.mark.skipif(not linear.QUANTISER, reason="this CPU lacks AVX2 with F16C: quant.py's torch ops quantise")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out_features, in_features", [(70, 96), (1, 32), (128, 2048), (577, 160)])
@pytest.mark.parametrize("grids", [False, True])
def test_the_c_quantiser_writes_the_torch_quantisers_bytes(fmt, out_features, in_features, grids):
    """quantize_packed's C quantiser (linear.quantise_weight: a bf16 weight straight into the kernels' layout)
    against quant.py's torch ops, byte for byte at any thread count: blocks of very different magnitudes, zero and
    constant blocks, ties between -0 and +0, values on exact half steps, ranges so small that Q4_1's float16 step
    is subnormal, and (``grids``: Q4_1 blocks searching 13 to 1 steps too) blocks on integer grids of a few steps."""
    from flared.model import quant

    if grids and fmt != "q4_1":
        pytest.skip("only Q4_1 searches grids")
    g = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=g) * torch.logspace(-4, 1, in_features)
    w = w.to(torch.bfloat16)
    if out_features > 5:
        w[1, :32] = 0  # zero block
        w[2, :32] = 0.375  # constant block
        w[3, :32] = torch.tensor([-0.0, 0.0] * 16)  # (either zero may be the least)
        w[4, :32] = torch.arange(32) * 2.0 ** -20 + 1e-3  # a range whose float16 step is subnormal
        w[5, :32] = torch.arange(32) - 15.5  # (values on exact halves of the Q8_0 step after scaling)
        levels = torch.randint(0, 16, (out_features, in_features), generator=g)
        w[6:, :] = ((levels - 8) * 0.0123).to(torch.bfloat16)[6:]  # (a GPTQ-like grid: most blocks span < 15 steps)
        w[6:, :32] = ((levels[6:, :32] % 9 - 3) * 0.5).to(torch.bfloat16)  # (9 levels: on the 8-step grid)
    reference = pack_q4_1(*quantize_q4_1(w, grids)) if fmt == "q4_1" else pack_q8_0(*quantize_q8_0(w))
    for threads in (1, 2, 3):
        got = quant.quantize_packed(fmt, w, threads, grids=grids)
        assert len(got) == len(reference)
        for a, b in zip(got, reference):
            assert a.shape == b.shape and a.dtype == b.dtype
            if out_features > 5 and a.dtype == torch.float16:  # (+0 and -0 offsets mean the same weights)
                assert torch.equal(a.float(), b.float())
            else:
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if fmt == "q4_1":
        with pytest.raises(ValueError, match="float16"):
            quant.quantize_packed(fmt, (torch.full((1, 32), 1e6) * torch.arange(32)).to(torch.bfloat16))


def test_the_names():
    assert check_quantization(None) is None and check_quantization("none") is None
    assert check_quantization("Q8_0") == "q8_0" and check_quantization("Q4_1") == "q4_1"
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        check_quantization("int4")


def _product(packed, x, out_features, threads):
    """x @ w^T over the packed tensors of either format (pack_q8_0's two, pack_q4_1's three)."""
    y = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
    pointers = [t.data_ptr() for t in packed]
    product = linear.q4_linear if len(packed) == 3 else linear.q8_linear
    product(*pointers, x.data_ptr(), y.data_ptr(), x.shape[0], out_features, x.shape[1], threads)
    return y


@pytest.fixture
def paths():
    """Restores the kernels' choices after a test sets them."""
    amx, q8_amx, q4_amx, dots = (linear.amx_min_rows(), linear.q8_amx_min_rows(), linear.q4_amx_min_rows(),
                                 linear.q8_vnni())
    yield
    linear.amx_min_rows(amx)
    linear.q8_amx_min_rows(q8_amx)
    linear.q4_amx_min_rows(q4_amx)
    linear.q8_vnni(int(dots))


def _quantised_amx_rows(rows: int) -> None:
    """Both formats' products on the AMX tiles from ``rows`` rows (0: never)."""
    linear.q8_amx_min_rows(rows)
    linear.q4_amx_min_rows(rows)


def _rows_as_the_dots_take_them(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] bf16 as the integer dots see it, float64: Q4_1's products quantise each block of 32 inputs of a
    row to int8 (scale = largest magnitude / 127, values x * (127 / largest) rounded to nearest-even in float32,
    qlinear_kernel.h's fl_quant_rows); Q8_0's to int16, exact for bf16 values within 2^15 of their block's largest."""
    if fmt != "q4_1":
        return x.double()
    blocks = x.float().reshape(x.shape[0], -1, 32)
    largest = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(largest > 0, 127.0 / largest, torch.zeros_like(largest))
    return (torch.round(blocks * inverse).double() * (largest / 127.0).double()).reshape(x.shape)


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out_features, in_features", [(100, 64), (576, 576), (130, 160)])
def test_every_path_against_the_bf16_kernel_and_float64(fmt, out_features, in_features, paths):
    """The widened paths (AMX tiles, or the bf16 kernel of this CPU) give bf16_linear's result over the dequantised
    weight bit for bit; the integer dots land within bf16's rounding of the exact product over the rows as they
    quantise them (Q8_0: to int16, which is bf16's x itself here; Q4_1: to int8 per block of 32, llama.cpp's Q8_1)."""
    from flared.model.decoder import pack_bf16

    g = torch.Generator().manual_seed(out_features)
    packed, weight, exact = _quantise(fmt, torch.randn(out_features, in_features, generator=g) + 0.05)
    bf16 = pack_bf16(weight)
    cases = [(0, 0, 0), (0, 0, 1)] + ([(1, 1, 1)] if linear.AMX else [])  # (amx rows, q8 amx rows, integer dots)
    for amx, q8_amx, dots in cases:
        linear.amx_min_rows(amx)
        _quantised_amx_rows(q8_amx)
        linear.q8_vnni(dots)
        for rows in (1, 2, 5, 6, 7, 13, 40):
            for threads in (1, 2):
                x = torch.randn(rows, in_features, generator=g).bfloat16()
                got = _product(packed, x, out_features, threads)
                if linear.quant_path(fmt, rows) == "dots":
                    ref = _rows_as_the_dots_take_them(fmt, x) @ exact.T
                    err = (got.double() - ref).abs() / (ref.abs() + ref.abs().mean())
                    assert err.max().item() < 8e-3, (rows, threads)  # (bf16's own rounding: 3.9e-3)
                else:
                    want = torch.empty_like(got)
                    linear.bf16_linear(bf16.data_ptr(), x.data_ptr(), want.data_ptr(), rows, out_features,
                                       in_features, threads)
                    assert torch.equal(got, want), (amx, q8_amx, rows, threads)


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_path_widens_as_the_format_says(fmt):
    """widen_quantised (the C widening, then bf16_unpack: the products of many rows where AMX is refused) gives the
    format's dequantised bf16 weight exactly, odd widths and padded groups included."""
    from flared.model.decoder import _Linear, widen_quantised

    g = torch.Generator().manual_seed(3)
    before = torch.get_num_threads()
    try:
        for out_features, in_features in ((70, 96), (576, 1536), (130, 64)):
            weight = (torch.randn(out_features, in_features, generator=g) - 0.1).bfloat16()
            lin = _Linear(weight, None, fmt)
            _, dequantised, _ = _quantise(fmt, weight)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                assert torch.equal(widen_quantised(lin), dequantised)
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        linear.q8_linear(1, 1, 1, 1, 1, 64, 48, 1)
    with pytest.raises(ValueError, match="null data pointer"):
        linear.q8_linear(0, 1, 1, 1, 1, 64, 64, 1)
    with pytest.raises(ValueError, match="q4_linear: null data pointer"):
        linear.q4_linear(1, 1, 0, 1, 1, 1, 64, 64, 1)


def _models(family, tmp_path, float32_twin=False, fmt="q8_0"):
    """(the bf16 model quantised at load, its bf16 twin whose products' weights are the dequantised ones[, the twin
    in float32])."""
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    source = read_source(build_hf_checkpoint(family, tmp_path))
    quantised = DecoderModel(source.config, source.tensors, dtype=torch.bfloat16, quantization=fmt)
    tensors = dict(source.tensors)

    def twin(t: torch.Tensor, name: str = "") -> torch.Tensor:
        return _quantise(HEAD_QUANTIZATION[fmt] if name == "lm_head.weight" else fmt, t.to(torch.bfloat16))[1]

    for name, t in source.tensors.items():
        if t.shape[-1] % 32 or name.startswith("embed") or "router" in name or "norm" in name:
            continue
        if t.dim() == 2:
            tensors[name] = twin(t, name)
        elif t.dim() == 3 and ".experts." in name:  # (a stack of routed experts' matrices)
            tensors[name] = torch.stack([twin(m) for m in t])
    twins = [DecoderModel(source.config, tensors, dtype=torch.bfloat16)]
    if float32_twin:
        twins.append(DecoderModel(source.config, tensors, dtype=torch.float32))
    return quantised, *twins


@needs_kernels
@pytest.mark.parametrize("family, fmt", [("llama3", "q8_0"), ("qwen2", "q8_0"), ("qwen3_moe", "q8_0"),
                                         ("mixtral", "q8_0"), ("llama3", "q4_1"), ("qwen3_moe", "q4_1")])
def test_a_quantised_model_against_its_dequantised_twin(family, fmt, tmp_path, paths):
    """Prefill chunks and decode rows (the one-call step where the CPU has it): the widened paths equal the bf16
    twin's logits bit for bit; the integer dots are as near the float32 twin as the bf16 twin is (Q8_0's rows
    quantised to 15 bits lose less than bf16's 8 do; Q4_1's to 7 bits, within a few times). Every product but the
    routers is quantised where its inputs are a multiple of 32 (Mixtral's test experts' 48-wide down products stay
    bf16), routed experts included; a dense model's products take 0.56x their bf16 bytes as Q8_0, 0.31x as Q4_1."""
    quantised, twin, twin32 = _models(family, tmp_path, float32_twin=True, fmt=fmt)
    for layer in quantised.layers:
        for lin in quantised._linears(layer):
            kept = lin.quant is not None and lin.quant_kind == fmt
            assert kept == (lin is not layer.router and lin.in_features % 32 == 0), (family, lin.in_features)
    if not quantised.config.num_experts:
        q_bytes = sum(lin.nbytes for layer in quantised.layers for lin in quantised._linears(layer))
        b_bytes = sum(lin.nbytes for layer in twin.layers for lin in twin._linears(layer))
        assert abs(q_bytes / b_bytes - FORMATS[fmt][4] / 2) < 0.02
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).tolist() for n in (9, 21, 40)]

    nxt = rng.integers(3, 500, 3).tolist()  # (the decode rows' tokens: the same for every model, near-ties aside)

    def run(model):
        kv = model.make_kv_cache(num_pages=12, page_tokens=16)
        tables = [np.arange(4 * i, 4 * i + 4) for i in range(3)]
        first = model.forward(ForwardBatch.build([SequenceChunk(p, 0, t) for p, t in zip(prompts, tables)],
                                                 page_tokens=16), kv)
        step = model.forward(ForwardBatch.build([SequenceChunk([n], len(p), t) for n, p, t in
                                                 zip(nxt, prompts, tables)], page_tokens=16), kv)
        return first.float(), step.float()

    exact = run(twin32)
    for q8_amx, dots in [(0, 0)] + ([(1, 0)] if linear.AMX else []) + ([(0, 1)] if linear.INTEGER_DOTS else []):
        linear.amx_min_rows(q8_amx)
        _quantised_amx_rows(q8_amx)
        linear.q8_vnni(dots)
        got, want = run(quantised), run(twin)
        if not dots:
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (q8_amx, dots)
            continue
        # (Q8_0's rows go to int16, finer than bf16's 8 bits; Q4_1's to int8 a block, 7 bits for its largest value
        # and fewer for the rest, as llama.cpp's: measured 2.2x the bf16 twin's distance)
        factor = 1.5 if fmt == "q8_0" else 4.0
        for q, b, f in zip(got, want, exact):
            bound = factor * (b - f).abs().max().item() + 1e-2 * f.abs().max().item()
            assert (q - f).abs().max().item() <= bound
            # each row's top token is float32's, or one within the bound of it (a near-tie)
            gap = f.max(-1).values - f.gather(-1, q.argmax(-1)[:, None])[:, 0]
            assert (gap <= 2 * bound).all(), gap


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_one_call_decode_step_runs_quantised_weights_as_the_per_op_path(fmt, tmp_path, paths):
    decode = pytest.importorskip("flared._fast.decode")
    if not decode.SUPPORTED:
        pytest.skip("this CPU lacks AVX-512 BF16")
    quantised, _ = _models("llama3", tmp_path, fmt=fmt)
    assert quantised.fused_decode
    rng = np.random.default_rng(1)
    kv = quantised.make_kv_cache(num_pages=24, page_tokens=16)
    chunks = []
    for r in range(6):
        n = int(rng.integers(1, 50))
        table = np.arange(4 * r, 4 * r + 4)
        quantised.forward(ForwardBatch.build([SequenceChunk(rng.integers(3, 500, n), 0, table)], page_tokens=16), kv)
        chunks.append(SequenceChunk([int(rng.integers(3, 500))], n, table))
    batch = ForwardBatch.build(chunks, page_tokens=16)
    before = (kv.keys.clone(), kv.values.clone())
    for q8_amx, dots in [(0, 0), (0, 1)] + ([(1, 0)] if linear.AMX else []):
        linear.amx_min_rows(q8_amx)
        _quantised_amx_rows(q8_amx)
        linear.q8_vnni(dots)
        results = []
        for fused in (True, False):
            kv.keys.copy_(before[0])
            kv.values.copy_(before[1])
            quantised.fused_decode = fused
            results.append(quantised.forward(batch, kv))
        quantised.fused_decode = True
        scale = results[1].abs().max().item()  # (silu's exp may round an activation apart, as for bf16 weights)
        assert (results[0] - results[1]).abs().max().item() <= 2e-3 * scale, (q8_amx, dots)
        assert torch.equal(results[0].argmax(-1), results[1].argmax(-1))


def test_quantisation_is_refused_where_it_cannot_run(tmp_path):
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    source = read_source(build_hf_checkpoint("llama3", tmp_path))
    with pytest.raises(ValueError, match="q8_0 weights run in bfloat16, on a GPU or on the CPU executor"):
        DecoderModel(source.config, source.tensors, dtype=torch.float32, quantization="q8_0")
    with pytest.raises(ValueError, match="unknown quantization"):
        DecoderModel(source.config, source.tensors, dtype=torch.bfloat16, quantization="awq")


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_an_untied_lm_head_keeps_one_quantised_copy(fmt, tmp_path):
    """Llama 3 (untied): the bf16 LM head is let go; token_logits (rerank, score) reads the dequantised rows, the
    same numbers the quantised products use."""
    from flared.model.decoder import widen_quantised

    quantised, twin = _models("llama3", tmp_path, fmt=fmt)
    assert quantised.lm_head is None and not quantised.config.tie_word_embeddings
    head = quantised.lm_head_linear
    ids = [0, 5, 63, 64, 200, quantised.config.vocab_size - 1]
    full = widen_quantised(head)
    assert head.quant_kind == HEAD_QUANTIZATION[fmt]  # (Q4_1 models keep their head as Q8_0)
    rows = FORMATS[head.quant_kind][3]
    assert torch.equal(rows(*head.quant_tensors, ids), full[ids])
    vectors = torch.randn(3, quantised.config.hidden_size)
    assert torch.allclose(quantised.token_logits(vectors, ids), twin.token_logits(vectors, ids))


@pytest.mark.skipif(linear.KERNEL != "avx512_bf16", reason="the run above already took this CPU's AVX2 paths")
def test_the_avx2_paths_in_a_process_of_their_own():
    """FLARED_AVX512=0: the AVX2 kernels (widened Q8_0 groups into the AVX2 bf16 kernel) on this AVX-512 host, the
    checks above over them."""
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                             "every_path or twin"], env={**os.environ, "FLARED_AVX512": "0"}, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout, result.stdout[-2000:]


@needs_kernels
@pytest.mark.parametrize("family", ["gemma3", "qwen3_5", "granite4_h", "lfm2", "deepseek_v2", "gpt_oss", "gemma4",
                                    "jamba", "kimi_linear", "llama4", "falcon_h1", "deepseek_v32", "bloom"])
def test_every_kind_of_layer_serves_quantised(family, tmp_path):
    """Recurrent mixers' projections (Gated DeltaNet, Mamba, short convolutions, KDA), latent attention with and
    without the indexer, biased and clamped experts, Gemma's per-layer inputs, ALiBi: a quantised prefill runs, its
    products are quantised, and its logits stay near the bf16 model's (these tiny random models part by 1.5-10% of the
    largest logit, as bf16 parts from float32 on them)."""
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    source = read_source(build_hf_checkpoint(family, tmp_path))
    models = [DecoderModel(source.config, source.tensors, dtype=torch.bfloat16, quantization=q)
              for q in (None, "q8_0", "q4_1")]
    for model in models[1:]:
        assert any(lin.quant is not None for layer in model.layers for lin in model._linears(layer))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, min(source.config.vocab_size, 500), n).tolist() for n in (9, 21)]
    logits = []
    for model in models:
        kv = model.make_kv_cache(num_pages=8, page_tokens=16, **({"state_rows": 2} if source.config.linear_layers
                                                                 else {}))
        chunks = [SequenceChunk(p, 0, np.arange(4 * i, 4 * i + 4)) for i, p in enumerate(prompts)]
        for i, chunk in enumerate(chunks):
            chunk.state_row = i
        logits.append(model.forward(ForwardBatch.build(chunks, page_tokens=16), kv).float())
    bf16, q8, q4 = logits
    assert torch.isfinite(q8).all() and torch.isfinite(q4).all()
    assert (q8 - bf16).abs().max().item() <= 0.15 * bf16.abs().max().item()
    # (a Q4_1 step is about 2 * 127 / 15 = 17 of Q8_0's: these models part from bf16 by 6-24 times Q8_0's distance)
    assert (q4 - bf16).abs().max().item() <= 32 * (q8 - bf16).abs().max().item()


def test_a_gguf_plan_keeps_each_layer_matrix_at_about_its_files_bits():
    """As llama.cpp's Q4_K_M mix holds some layers' attn_v and ffn_down as Q6_K: those matrices (the fused qkv that
    takes attn_v in) as q8_0, the Q4_K rest as the default q4_1; 5-bit types as q8_0 (never fewer bits than the
    file's), 16-bit ones as bf16 (None); a file mostly at 16 bits keeps nothing quantised."""
    from flared.model.quant import QuantPlan, gguf_plan, gguf_type_format

    assert [gguf_type_format(t) for t in ("Q4_K", "Q4_0", "IQ4_XS", "Q5_K", "Q5_0", "Q6_K", "Q8_0", "F16", "BF16")] \
        == ["q4_1", "q4_1", "q4_1", "q8_0", "q8_0", "q8_0", "q8_0", None, None]
    types = {"token_embd.weight": ["Q6_K", 10_000], "output_norm.weight": ["F32", 64]}
    for i in range(4):
        more = i in (0, 3)  # (llama.cpp's use_more_bits layers, in part)
        for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            types[f"blk.{i}.{part}.weight"] = ["Q4_K", 4096]
        types[f"blk.{i}.attn_v.weight"] = ["Q6_K" if more else "Q4_K", 1024]
        types[f"blk.{i}.ffn_down.weight"] = ["Q6_K" if more else "Q4_K", 8192]
    types["blk.2.attn_output.weight"] = ["F16", 4096]
    plan = gguf_plan(types)
    assert plan == QuantPlan("q4_1", {"layers.0.qkv.weight": "q8_0", "layers.0.down.weight": "q8_0",
                                      "layers.3.qkv.weight": "q8_0", "layers.3.down.weight": "q8_0",
                                      "layers.2.o.weight": None}, grids=True)
    assert plan.format_of("layers.1.qkv.weight") == "q4_1" and plan.format_of(None) == "q4_1"
    assert plan.digest() != QuantPlan("q4_1").digest()
    assert gguf_plan({"blk.0.attn_q.weight": ["Q5_K", 10], "blk.0.ffn_down.weight": ["Q6_K", 30]}) == \
        QuantPlan("q8_0", grids=True)
    assert gguf_plan({"blk.0.attn_q.weight": ["F16", 100], "blk.0.ffn_down.weight": ["Q4_K", 10]}) is None


@needs_kernels
def test_a_plan_keeps_each_matrix_in_its_format_and_the_logits_follow(tmp_path, paths):
    """DecoderModel(quantization=QuantPlan): each named matrix in its format (None: bf16), the rest in the default;
    prefill and decode logits equal, bit for bit, those of the bf16 model whose weights are each matrix's
    dequantised ones; the one-call decode step takes the mix as the per-op path does."""
    from flared.model.decoder import DecoderModel, widen_quantised
    from flared.model.loader import read_source
    from flared.model.quant import QuantPlan

    source = read_source(build_hf_checkpoint("llama3", tmp_path))
    plan = QuantPlan("q4_1", {"layers.0.qkv.weight": "q8_0", "layers.0.down.weight": None,
                              "layers.1.gate_up.weight": "q8_0"})
    model = DecoderModel(source.config, source.tensors, dtype=torch.bfloat16, quantization=plan)
    kinds = {f"layers.{i}.{key}.weight": getattr(layer, key).quant_kind
             for i, layer in enumerate(model.layers) for key in ("qkv", "o", "gate_up", "down")}
    assert kinds == {"layers.0.qkv.weight": "q8_0", "layers.0.o.weight": "q4_1", "layers.0.gate_up.weight": "q4_1",
                     "layers.0.down.weight": None, "layers.1.qkv.weight": "q4_1", "layers.1.o.weight": "q4_1",
                     "layers.1.gate_up.weight": "q8_0", "layers.1.down.weight": "q4_1"}
    assert model.quantization == "q4_1" and model.lm_head_linear.quant_kind == HEAD_QUANTIZATION["q4_1"]
    tensors = dict(source.tensors)
    for i, layer in enumerate(model.layers):
        for key in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, key)
            if lin.quant is not None:  # (a copy: widen_quantised's scratch is overwritten by the next call)
                tensors[f"layers.{i}.{key}.weight"] = widen_quantised(lin).clone()
    assert "lm_head.weight" in tensors  # (untied: the embedding rows stay as they are)
    tensors["lm_head.weight"] = widen_quantised(model.lm_head_linear).clone()
    twin = DecoderModel(source.config, tensors, dtype=torch.bfloat16)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 500, n).tolist() for n in (7, 30)]
    nxt = rng.integers(3, 500, 2).tolist()

    def run(m, fused=True):
        m.fused_decode = m.fused_decode and fused
        kv = m.make_kv_cache(num_pages=8, page_tokens=16)
        tables = [np.arange(2 * i, 2 * i + 2) for i in range(2)]
        first = m.forward(ForwardBatch.build([SequenceChunk(p, 0, t) for p, t in zip(prompts, tables)],
                                             page_tokens=16), kv)
        step = m.forward(ForwardBatch.build([SequenceChunk([n], len(p), t) for n, p, t in zip(nxt, prompts, tables)],
                                            page_tokens=16), kv)
        return first.float(), step.float()

    linear.amx_min_rows(0)
    _quantised_amx_rows(0)
    linear.q8_vnni(0)
    fused = model.fused_decode
    got = run(model, fused=False)
    assert all(torch.equal(a, b) for a, b in zip(got, run(twin, fused=False)))
    if fused:  # (AVX-512 BF16: the one-call step, every layer's formats from its pointers)
        model.fused_decode = True
        one_call = run(model)[1]
        assert (one_call - got[1]).abs().max().item() <= 2e-3 * got[1].abs().max().item()
        assert torch.equal(one_call.argmax(-1), got[1].argmax(-1))


def test_a_gguf_files_mix_is_recorded_and_served_as_it_holds_it(default_gguf, tiny_hf_llama, tmp_path):
    """The embedded model's GGUF (Q4_1 matrices) written again with layer 0's attn_v and ffn_down as Q8_0 and layer
    1's attn_output as F16: its core records each tensor's type, and --quantization gguf keeps qkv and down of
    layer 0 as q8_0, layer 1's o as bf16, the rest as q4_1. A core exported from a checkpoint directory refuses gguf
    with the reason."""
    from gguf import GGMLQuantizationType as T

    from flared.core.export import ExportOptions, export_core
    from flared.errors import ExecutionError
    from flared.model.quant import QuantPlan, resolve_quantization
    from flared.runtime.oneshot import OneShot
    from flared_testing.checkpoints import retype_gguf

    mix = {"blk.0.attn_v.weight": T.Q8_0, "blk.0.ffn_down.weight": T.Q8_0, "blk.1.attn_output.weight": T.F16}
    retype_gguf(default_gguf, tmp_path / "mix.gguf", lambda name, kind: mix.get(name, kind))
    manifest = export_core(tmp_path / "mix.gguf", tmp_path / "core", ExportOptions(dtype="bfloat16"))
    types = manifest.source["tensor_types"]
    assert types["blk.0.attn_v.weight"][0] == "Q8_0" and types["blk.1.attn_q.weight"] == ["Q4_1", 576 * 576]
    assert "blk.0.attn_norm.weight" not in types  # (matrices only)
    assert resolve_quantization("gguf", manifest.source) == QuantPlan(
        "q4_1", {"layers.0.qkv.weight": "q8_0", "layers.0.down.weight": "q8_0", "layers.1.o.weight": None},
        grids=True)
    assert resolve_quantization("q8_0", manifest.source) == "q8_0"
    assert resolve_quantization("q4_1", manifest.source) == QuantPlan("q4_1", grids=True)  # (its Q4_1 tensors)
    assert resolve_quantization("q4_1", {"kind": "gguf", "tensor_types": {"blk.0.attn_q.weight": ["F16", 9]}}) == "q4_1"
    with pytest.raises(ValueError, match="malformed source.tensor_types"):
        resolve_quantization("gguf", {"kind": "gguf", "tensor_types": {"blk.0.attn_q.weight": 7}})
    if linear.BF16_SUPPORTED:
        engine = OneShot.open(tmp_path / "core", quantization="gguf")
        layers = engine.runner.model.layers
        assert [layers[0].qkv.quant_kind, layers[0].o.quant_kind, layers[0].down.quant_kind,
                layers[1].o.quant_kind, layers[1].down.quant_kind] == ["q8_0", "q4_1", "q8_0", None, "q4_1"]
        out = engine.generate(prompt="The capital of France is", max_tokens=4, temperature=0)
        assert out["usage"]["completion_tokens"] == 4
    export_core(tiny_hf_llama, tmp_path / "hf-core", ExportOptions(dtype="bfloat16"))
    with pytest.raises(ExecutionError, match="exported from a checkpoint directory"):
        OneShot.open(tmp_path / "hf-core", quantization="gguf")


def test_q4_k_blocks_come_back_on_their_own_grid():
    """A GGUF's Q4_K values (blocks set by llama.cpp's search, which often spans 14 of a block's steps, not 15)
    quantised to Q4_1 land on their own grids: within a tenth of the Q4_K's own distance from the weights, where
    the 15-step grid alone moved them more than half of it. On plain weights every block's grid is at least as
    near as the 15-step one."""
    import gguf

    from flared.model.quant import _place_q4_1
    from flared_testing.checkpoints import q4_k_blocks

    rng = np.random.default_rng(4)
    weights = (rng.standard_t(4, (64, 1024)) * 0.02).astype(np.float32)
    kept = torch.from_numpy(gguf.quants.dequantize(q4_k_blocks(weights), gguf.GGMLQuantizationType.Q4_K)
                            .reshape(weights.shape)).to(torch.bfloat16)
    own = (kept.float() - torch.from_numpy(weights)).pow(2).mean().sqrt().item()
    blocks = kept.float().reshape(64, 32, 32)
    low, high = blocks.amin(-1), blocks.amax(-1)
    steps15 = ((high - low) / 15.0).to(torch.float16)
    q15, _ = _place_q4_1(blocks, steps15, low.to(torch.float16))
    moved15 = (dequantize_q4_1(q15.reshape(64, 1024), steps15, low.to(torch.float16), torch.float32)
               - kept.float()).pow(2).mean().sqrt().item()
    q, steps, offsets = quantize_q4_1(kept)
    moved = (dequantize_q4_1(q, steps, offsets, torch.float32) - kept.float()).pow(2).mean().sqrt().item()
    assert moved < 0.1 * own and moved15 > 0.5 * own, (moved, moved15, own)
    assert (steps != steps15).float().mean().item() > 0.1  # (the blocks that span 14 steps)
    plain = torch.from_numpy(weights).to(torch.bfloat16).float().reshape(64, 32, 32)
    low, high = plain.amin(-1), plain.amax(-1)
    _, on15 = _place_q4_1(plain, ((high - low) / 15.0).to(torch.float16), low.to(torch.float16))
    q, steps, offsets = quantize_q4_1(plain.reshape(64, 1024))
    _, on_kept = _place_q4_1(plain, steps, offsets)
    assert (on_kept <= on15).all() and on_kept.sum() < on15.sum()


def test_integer_grids_come_back_as_they_were():
    """Values on a GPTQ/AWQ-style grid (a scale per 64 inputs times 0..15 less a zero point) quantised to Q4_1 with
    ``grids`` come back as they were but for bf16's rounding (0.007 of a step RMS), where the 15- and 14-step grids
    alone moved them by a fifth of a step RMS; on plain weights every block is at least as near."""
    g = torch.Generator().manual_seed(5)
    scales = (torch.rand(96, 16, 1, generator=g) * 0.01 + 0.001).half().float()
    zeros = torch.randint(4, 12, (96, 16, 1), generator=g).float()
    levels = torch.clamp(torch.round(torch.randn(96, 16, 64, generator=g) * 3 + zeros), 0, 15)
    values = (scales * (levels - zeros)).reshape(96, 1024).to(torch.bfloat16)
    step = scales.expand(96, 16, 64).reshape(96, 1024)

    def moved(grids: bool) -> torch.Tensor:
        back = dequantize_q4_1(*quantize_q4_1(values, grids), torch.float32)
        return ((back - values.float()).abs() / step).amax(), ((back - values.float()) / step).pow(2).mean().sqrt()

    (worst, rms), (worst_plain, rms_plain) = moved(True), moved(False)
    # (what is left is bf16's rounding of the values and of the block's ends: under a twentieth of a step)
    assert worst < 0.06 and rms < 0.01, (worst, rms, worst_plain, rms_plain)
    assert rms_plain > 0.1 and worst_plain > 0.3, (worst_plain, rms_plain)  # (without the search)
    plain = torch.randn(64, 1024, generator=g).to(torch.bfloat16)
    from flared.model.quant import _place_q4_1

    blocks = plain.float().reshape(64, 32, 32)
    _, searched = _place_q4_1(blocks, *[t for t in quantize_q4_1(plain, True)[1:]])
    _, first = _place_q4_1(blocks, *[t for t in quantize_q4_1(plain, False)[1:]])
    assert (searched <= first).all()


@needs_kernels
def test_a_plan_reaches_a_mixtures_experts_and_shared_expert(tmp_path):
    """A Q4_K_M mixture of experts holds some layers' ffn_down_exps at Q6_K: the plan names the layer's expert
    stacks and shared expert, and every expert of a stack takes its format."""
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source
    from flared.model.quant import QuantPlan, gguf_plan

    types = {"blk.0.ffn_gate_exps.weight": ["Q4_K", 100], "blk.0.ffn_up_exps.weight": ["Q4_K", 100],
             "blk.0.ffn_down_exps.weight": ["Q6_K", 100], "blk.0.ffn_gate_shexp.weight": ["Q8_0", 10],
             "blk.0.ffn_up_shexp.weight": ["Q4_K", 10], "blk.0.ffn_down_shexp.weight": ["Q4_K", 10],
             "blk.1.ffn_down_exps.weight": ["Q4_K", 100]}
    assert gguf_plan(types) == QuantPlan("q4_1", {"layers.0.experts.down.weight": "q8_0",
                                                  "layers.0.shared.gate_up.weight": "q8_0"}, grids=True)
    source = read_source(build_hf_checkpoint("qwen2_moe", tmp_path))
    plan = QuantPlan("q4_1", {"layers.0.experts.down.weight": "q8_0", "layers.0.shared.gate_up.weight": None,
                              "layers.1.experts.gate_up.weight": "q8_0"})
    model = DecoderModel(source.config, source.tensors, dtype=torch.bfloat16, quantization=plan)
    first, second = model.layers[0], model.layers[1]
    assert {a.quant_kind for a, _ in first.experts} == {"q4_1"} and {b.quant_kind for _, b in first.experts} == {"q8_0"}
    assert {a.quant_kind for a, _ in second.experts} == {"q8_0"} and {b.quant_kind for _, b in second.experts} == {"q4_1"}
    # (the shared expert's down takes 48 inputs, not a multiple of 32: bf16 whatever the plan says)
    assert first.shared[0].quant_kind is None and first.shared[1].quant_kind is None
    assert second.shared[0].quant_kind == "q4_1"
    kv = model.make_kv_cache(num_pages=4, page_tokens=16)
    logits = model.forward(ForwardBatch.build([SequenceChunk(list(range(3, 20)), 0, np.arange(2))], page_tokens=16), kv)
    assert torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_the_gpu_layout_holds_the_same_blocks(fmt):
    """quant.gpu_layout (kernels/wquant.py's tensors) holds the quantiser's blocks: its values are the dequantised
    weight's, the inputs padded to whole turns with zeros, a stored core's tensors come back to them (unpack_stored);
    value j of a turn's word row r is the turn's input 16 j + r, and the top value sets the word's sign bit without
    spilling into it."""
    from flared.model.quant import GPU_TURN, gpu_layout, gpu_quantize, gpu_values, quantize_packed, unpack_stored

    quantize, dequantize = FORMATS[fmt][:2]
    bits, per_word = (4, 8) if fmt == "q4_1" else (8, 4)
    g = torch.Generator().manual_seed(3)
    inputs = 224  # (padded to 256: Q4_1 two turns, the second part padding; Q8_0 four)
    w = (torch.randn(70, inputs, generator=g) * torch.logspace(-3, 0, inputs)).to(torch.bfloat16)
    params = quantize(w)
    parts = gpu_quantize(fmt, w)
    assert [tuple(p.shape) for p in parts] == [(256 // per_word, 70)] + [(256 // 32, 70)] * (len(parts) - 1)
    assert torch.equal(gpu_values(parts, fmt, in_features=inputs), dequantize(*params))
    assert not gpu_values(parts, fmt)[:, inputs:].any()
    assert all(torch.equal(a, b) for a, b in zip(unpack_stored(quantize_packed(fmt, w), fmt, 70), params))
    values = params[0].to(torch.int32) & ((1 << bits) - 1)
    turn = GPU_TURN[fmt]
    # (word row, value j): the first word, a middle one, a top value, the second turn's
    for row, j in ((0, 0), (5, 3), (11, per_word - 1), (16 + 11, per_word // 2), (16 + 2, 1)):
        k = row // 16 * turn + 16 * j + row % 16
        assert k < inputs and torch.equal((parts[0][row] >> (bits * j)) & ((1 << bits) - 1), values[:, k]), (row, j)
    if fmt == "q4_1":
        q = torch.full((2, 128), 15, dtype=torch.uint8)
        q[1, 7 * 16:] = 0  # (value 7 of every word: its top nibble)
        ones, zeros = torch.ones(2, 4, dtype=torch.float16), torch.zeros(2, 4, dtype=torch.float16)
        words = gpu_layout(fmt, q, ones, zeros)[0]
        assert words.dtype == torch.int32 and (words[:, 0] == -1).all() and (words[:, 1] == 0x0FFFFFFF).all()
        assert torch.equal(gpu_values((words, ones.t(), zeros.t()), fmt), q.to(torch.bfloat16))
