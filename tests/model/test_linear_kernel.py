"""The AVX-512 BF16 matrix kernel over packed weights (flared/_fast/linear_kernel.h) against float64
references of the same bf16 values, exact rounding where the float32 sum is exact, odd shapes, row counts
and thread counts, the decoder's _Linear wrapper (bias, non-contiguous input), and bf16 decoding through
DecoderModel against torch's path."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from flared._fast import linear as linear_mod
from flared.model import decoder as decoder_mod
from flared.model.batch import ForwardBatch, SequenceChunk
from flared.model.decoder import DecoderModel, _Linear, pack_bf16
from flared.model.loader import read_source

from .conftest import build_hf_checkpoint

needs_isa = pytest.mark.skipif(not linear_mod.BF16_SUPPORTED,
                               reason="CPU lacks AVX-512 BF16 (or not x86-64 Linux): the kernel is not used here")

# SmolLM2-135M's products (qkv, o, gate_up, down, lm_head) and shapes whose output dimension is not a
# multiple of the 64-feature group (the kernel needs an even reduced dimension).
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
ODD_SHAPES = [(1, 2), (3, 30), (17, 34), (65, 100), (130, 578), (200, 1000), (129, 64)]
# Every register-block tail (blocks of 6 rows) up to two blocks, and a prefill-sized count.
ROW_COUNTS = list(range(1, 14)) + [40]


def kernel(w: torch.Tensor, x: torch.Tensor, threads: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    packed = pack_bf16(w)
    linear_mod.bf16_linear(packed.data_ptr(), x.data_ptr(), y.data_ptr(), x.shape[0], w.shape[0], w.shape[1],
                           threads)
    return y


def check_against_float64(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y is float32-accumulated and rounded once to bf16: within half a bf16 ulp of the exact sum plus a
    float32 accumulation error bounded by the sum of |products|."""
    exact = x.double() @ w.double().t()
    magnitude = x.double().abs() @ w.double().abs().t()
    err = (y.double() - exact).abs()
    bound = exact.abs() * 2.0 ** -8 + magnitude * 2.0 ** -16 + 1e-30
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f}x the bound"


@needs_isa
@pytest.mark.parametrize("out_features,in_features", SMOLLM2_SHAPES + ODD_SHAPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_matches_float64_reference(out_features, in_features, threads):
    gen = torch.Generator().manual_seed(out_features * 7919 + in_features)
    w = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    for rows in ROW_COUNTS if out_features < 10000 else (1, 7, 40):
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        check_against_float64(kernel(w, x, threads), x, w)


@needs_isa
@pytest.mark.parametrize("threads", [1, 2])
def test_round_to_nearest_even_exactly(threads):
    """Small integers make every float32 partial sum exact (|sum| < 2^24), so the only rounding is the
    final one to bf16: it must equal torch's float32 -> bf16 conversion bit for bit (ties to even)."""
    gen = torch.Generator().manual_seed(5)
    for out_features, in_features in [(300, 578), (64, 1536), (7, 40)]:
        w = torch.randint(-16, 17, (out_features, in_features), generator=gen).to(torch.bfloat16)
        x = torch.randint(-16, 17, (9, in_features), generator=gen).to(torch.bfloat16)
        exact = (x.double() @ w.double().t()).float()
        assert exact.abs().max() < 2 ** 24
        y = kernel(w, x, threads)
        assert torch.equal(y.view(torch.int16), exact.to(torch.bfloat16).view(torch.int16))
    # One tie, spelled out: 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6; even is 1 + 2^-6.
    w = torch.tensor([[1.0, 3 * 2.0 ** -8]], dtype=torch.bfloat16)
    x = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    assert kernel(w, x, 1).item() == 1 + 2.0 ** -6


@needs_isa
def test_nan_and_inf_propagate():
    w = torch.ones(70, 40, dtype=torch.bfloat16)
    x = torch.ones(2, 40, dtype=torch.bfloat16)
    x[0, 3] = float("nan")
    x[1, 39] = float("inf")
    y = kernel(w, x, 2)
    assert torch.isnan(y[0]).all() and torch.isposinf(y[1]).all()


@needs_isa
def test_bad_arguments_raise():
    w = torch.ones(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bad shape"):
        linear_mod.bf16_linear(w.data_ptr(), w.data_ptr(), w.data_ptr(), 0, 4, 8)
    with pytest.raises(ValueError, match="must be even"):
        linear_mod.bf16_linear(w.data_ptr(), w.data_ptr(), w.data_ptr(), 1, 4, 7)
    with pytest.raises(ValueError, match="null"):
        linear_mod.bf16_linear(0, w.data_ptr(), w.data_ptr(), 1, 4, 8)


@needs_isa
def test_concurrent_callers_get_their_own_results():
    """The GIL is released during a product: callers on several Python threads each get their own
    OpenMP team and their own results."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(2048, 576, generator=gen).to(torch.bfloat16)
    xs = [torch.randn(3, 576, generator=gen).to(torch.bfloat16) for _ in range(4)]
    expected = [kernel(w, x, 1) for x in xs]
    failures = []

    def worker(i):
        for _ in range(50):
            if not torch.equal(kernel(w, xs[i], 2), expected[i]):
                failures.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


@needs_isa
def test_linear_wrapper_bias_and_noncontiguous_input():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, 96, generator=gen).to(torch.bfloat16)
    bias = torch.randn(200, generator=gen).to(torch.bfloat16)
    lin = _Linear(w, bias)
    assert lin.packed is not None and lin.weight is None  # only the packed copy is kept
    wide = torch.randn(96, 12, generator=gen).to(torch.bfloat16)
    x = wide.t()[2:7]  # [5, 96], column-major strides
    assert not x.is_contiguous()
    y = lin(x)
    assert y.shape == (5, 200) and y.dtype == torch.bfloat16
    exact = x.double() @ w.double().t() + bias.double()
    # Two roundings to bf16 (product, then + bias), each within half an ulp.
    magnitude = x.double().abs() @ w.double().abs().t() + bias.double().abs()
    assert ((y.double() - exact).abs() <= magnitude * 2.0 ** -7).all()
    with pytest.raises(ValueError, match="does not match"):
        lin(torch.ones(2, 95, dtype=torch.bfloat16))
    # Prefill-sized inputs go through the kernel too; float32 weights and odd input widths keep torch's path.
    many = torch.randn(70, 96, generator=gen).to(torch.bfloat16)
    exact = many.double() @ w.double().t() + bias.double()
    magnitude = many.double().abs() @ w.double().abs().t() + bias.double().abs()
    assert ((lin(many).double() - exact).abs() <= magnitude * 2.0 ** -7).all()
    assert _Linear(w.float(), None).packed is None
    odd = _Linear(w[:, :95].contiguous(), None)
    assert odd.packed is None and torch.equal(odd(many[:, :95]), F.linear(many[:, :95], w[:, :95]))


@needs_isa
@pytest.mark.parametrize("out_features, in_features", SMOLLM2_SHAPES[:4] + ODD_SHAPES)
@pytest.mark.parametrize("threads", [1, 3])
def test_unpack_gives_the_weight_back(out_features, in_features, threads):
    """bf16_unpack: the packed layout back to the exact weight (group tails, odd sizes, any thread count)."""
    if in_features % 2:
        pytest.skip("packing needs an even input size")
    w = torch.randn(out_features, in_features).to(torch.bfloat16)
    out, packed = torch.empty_like(w), pack_bf16(w)
    linear_mod.bf16_unpack(packed.data_ptr(), out.data_ptr(), out_features, in_features, threads)
    assert torch.equal(out, w)


@pytest.mark.parametrize("out_features, in_features", SMOLLM2_SHAPES + ODD_SHAPES)
@pytest.mark.parametrize("threads", [1, 3])
def test_the_c_packer_lays_weights_out_as_the_torch_ops(out_features, in_features, threads):
    """bf16_pack (pack_bf16's C path) writes the layout these torch ops make, bit for bit: groups of 64 output
    features, each [in / 2, 64, 2], zero rows past out_features."""
    if in_features % 2:
        pytest.skip("packing needs an even input size")
    w = torch.randn(out_features, in_features).to(torch.bfloat16)
    w[0, :2] = torch.tensor([float("nan"), -0.0])  # (moved as bits)
    padded = -(-out_features // 64) * 64
    reference = torch.cat([w, w.new_zeros(padded - out_features, in_features)]).reshape(
        padded // 64, 64, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()
    packed = torch.full_like(reference, 7.0)  # (the padding rows must be written, not left as they were)
    linear_mod.bf16_pack(w.data_ptr(), packed.data_ptr(), out_features, in_features, threads)
    assert torch.equal(packed.view(torch.int16), reference.view(torch.int16))
    assert torch.equal(pack_bf16(w).view(torch.int16), reference.view(torch.int16))


@pytest.mark.skipif(not linear_mod.AMX, reason="no AMX tiles on this CPU")
def test_amx_tiles_and_the_avx512_kernel_agree_and_can_be_turned_off():
    """Where the CPU has AMX the products run on its tiles: the same bf16 results as the AVX-512 kernel up to the
    float32 sums' order (one bf16 step at most, on a few outputs), at every row-block tail; amx_min_rows(0) turns them
    off, and FLARED_AMX=0 keeps a process from them."""
    import subprocess
    import sys

    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 576, generator=g).to(torch.bfloat16)
    for rows in (1, 15, 16, 17, 40):
        x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
        tiles = kernel(w, x, 2)
        fewest = linear_mod.amx_min_rows()
        linear_mod.amx_min_rows(0)
        try:
            avx512 = kernel(w, x, 2)
        finally:
            linear_mod.amx_min_rows(fewest)
        reference = (x.double() @ w.double().T)
        assert (tiles.double() - reference).abs().max().item() <= 0.02 * reference.abs().max().item()
        assert (tiles.float() - avx512.float()).abs().max().item() <= 0.01 * reference.abs().max().item()
    code = "from flared._fast import linear; print(linear.AMX, linear.amx_min_rows())"
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "FLARED_AMX": "0"}, check=True)
    assert off.stdout.split() == ["False", "0"]


@needs_isa
def test_many_rows_take_torchs_product_where_it_is_faster(monkeypatch):
    """At UNPACK_MIN_ROWS rows and more (set on a CPU with AMX) _Linear unpacks its weight and runs torch's product:
    the same values as torch's F.linear on the original weight, bias included; fewer rows keep the kernel."""
    w, b = torch.randn(130, 578).to(torch.bfloat16), torch.randn(130).to(torch.bfloat16)
    lin = _Linear(w.clone(), b)
    monkeypatch.setattr(decoder_mod, "UNPACK_MIN_ROWS", 16)
    x = torch.randn(20, 578).to(torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x, w, b))
    few = torch.randn(15, 578).to(torch.bfloat16)
    assert torch.equal(lin(few), kernel(w, few, 1).add_(b))


def test_decode_sized_float32_products_take_the_faster_way_and_agree(monkeypatch):
    """Float32 products of a few rows run as the split bmm where the probe finds it faster on this CPU (or
    SPLIT_DECODE_PRODUCTS says so), else F.linear: the same values either way (to float32 rounding)."""
    w, x = torch.randn(300, 96), torch.randn(3, 96)
    lin = _Linear(w.clone(), None)
    assert isinstance(decoder_mod.split_pays(), bool)
    results = []
    for choice in (True, False):
        monkeypatch.setattr(decoder_mod, "SPLIT_DECODE_PRODUCTS", choice)
        assert decoder_mod.split_pays() is choice
        results.append(lin(x))
    assert torch.allclose(results[0], results[1], atol=1e-5) and torch.allclose(results[1], F.linear(x, w), atol=1e-5)


def test_wrapper_off_without_isa(monkeypatch):
    """Where the ISA is missing the wrapper must not pick the kernel (CI machines may differ)."""
    monkeypatch.setattr(decoder_mod, "BF16_SUPPORTED", False)
    w = torch.randn(64, 32).to(torch.bfloat16)
    lin = _Linear(w, None)
    assert lin.packed is None
    x = torch.randn(2, 32).to(torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x, w))


def decode_logits(model: DecoderModel, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """Prefill ``prompt`` (one forward), then decode ``forced`` tokens one per forward; returns the
    logits [len(forced) + 1, vocab] of every forward."""
    page_tokens = 16
    kv = model.make_kv_cache(num_pages=8, page_tokens=page_tokens)
    pages = list(range(8))
    logits = []
    computed = 0
    for new in [prompt] + [[t] for t in forced]:
        batch = ForwardBatch.build([SequenceChunk(new, computed, pages, True)], page_tokens=page_tokens,
                                   sliding_window=model.config.sliding_window, device=model.device)
        logits.append(model.forward(batch, kv)[0])
        computed += len(new)
    return torch.stack(logits)


def compare_decode(make_model, prompt: list[int], monkeypatch, num_steps: int = 6):
    """Logits of a prefill and ``num_steps`` decode steps through the kernels (packed products, one-call
    decode layers) and through torch's ops (a model built as if the CPU lacked the ISA), decoding the
    tokens torch's path picks."""
    with monkeypatch.context() as m:
        m.setattr(decoder_mod, "BF16_SUPPORTED", False)
        plain = make_model()
    assert all(layer.qkv.packed is None for layer in plain.layers)
    forced: list[int] = []
    torch_logits = decode_logits(plain, prompt, forced)
    for _ in range(num_steps):
        forced.append(int(torch_logits[-1].argmax()))
        torch_logits = decode_logits(plain, prompt, forced)
    calls = []
    real = decoder_mod.bf16_linear

    def counting(*args):
        calls.append(args[3])
        return real(*args)

    monkeypatch.setattr(decoder_mod, "bf16_linear", counting)
    model = make_model()
    ours = decode_logits(model, prompt, forced)
    assert len(prompt) in calls  # the kernel ran the prefill's products
    return ours, torch_logits


@needs_isa
def test_decoder_bf16_decode_matches_torch_path_tiny_qwen2(tmp_path, monkeypatch):
    """qwen2 has qkv biases; prompt of 5 tokens so the prefill also goes through the kernel."""
    torch.set_num_threads(2)
    try:
        source = read_source(build_hf_checkpoint("qwen2", tmp_path))
        ours, ref = compare_decode(lambda: DecoderModel(source.config, source.tensors, dtype=torch.bfloat16),
                                   [5, 17, 99, 3, 42], monkeypatch)
    finally:
        torch.set_num_threads(1)
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= 0.03 * scale
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@needs_isa
def test_decoder_bf16_decode_matches_torch_path_smollm2(smollm2_source, monkeypatch):
    ours, ref = compare_decode(lambda: DecoderModel(smollm2_source.config, smollm2_source.tensors,
                                                    dtype=torch.bfloat16, max_positions=256),
                               [1, 504, 3458, 282, 4649, 314], monkeypatch)
    # bf16 activations through 30 layers: both paths round differently at every product, so logits
    # agree to a few percent of their range, not bitwise.
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= 0.05 * scale
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 6 / 7
