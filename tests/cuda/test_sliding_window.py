"""Sliding-window attention (Mistral) on the CUDA decoder.

The Triton kernels with a window (decode: one pass, split over the context, with the rotary and KV write folded
in; chunked prefill: packed sequences over cached prefixes, with and without the unmasked middle tiles) against
a float64 reference that lets a query at position p see keys (p - window, p]; then the graph executor's float32
greedy tokens on a random-weight Mistral, prompts longer than its window, against transformers' and the CPU
path's.
"""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))

from gpu_models import CONTEXT, make_cpu_executor, make_executor, make_scheduler, serving_model  # noqa: E402

P = 16  # page tokens
NUM_PAGES = 128  # 25 pages (400 tokens) a row of five, 42 of three


def _pool(nkv, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = ((NUM_PAGES + 1) * P, nkv, d)  # the last page: padding rows' scratch slots
    return (torch.randn(shape, device="cuda", generator=g).to(dtype),
            torch.randn(shape, device="cuda", generator=g).to(dtype))


def _tables(rows, seed):
    """Each row's pages: a shuffled, disjoint run of the pool's pages."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(NUM_PAGES, generator=g).to(torch.int32)
    per = NUM_PAGES // rows
    return torch.stack([pages[r * per:(r + 1) * per] for r in range(rows)]).cuda()


def _slots(table_row, positions):
    return (table_row.long()[positions // P] * P + positions % P)


def _reference(q, k_pool, v_pool, table_row, q_positions, window, scale):
    """q [n, nh, d] at absolute q_positions [n]: each sees keys (p - window, p] (all of [0, p] without one)."""
    nh, nkv = q.shape[1], k_pool.shape[1]
    group = nh // nkv
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for i, p in enumerate(q_positions.tolist()):
        lo = max(0, p - window + 1) if window else 0
        keys = _slots(table_row, torch.arange(lo, p + 1, device=q.device))
        k = k_pool[keys].double().repeat_interleave(group, dim=1)  # [n_keys, nh, d]
        v = v_pool[keys].double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,khd->hk", q[i].double(), k) * scale
        out[i] = torch.einsum("hk,khd->hd", s.softmax(-1), v)
    return out


@pytest.mark.parametrize("window", [7, 64, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernels_see_only_the_window(window, dtype):
    from flared.model.triton_attention import paged_decode_attention, paged_decode_attention_split

    nh, nkv, d = 8, 2, 64
    lens = torch.tensor([0, 1, 20, 70, 200], dtype=torch.int32, device="cuda")
    rows = lens.numel()
    k_pool, v_pool = _pool(nkv, d, dtype, seed=window)
    tables = _tables(rows, seed=window)
    q = torch.randn(rows, nh, d, device="cuda").to(dtype)
    scale = d ** -0.5
    want = torch.zeros(rows, nh, d, dtype=torch.float64, device="cuda")
    for r in range(1, rows):
        want[r] = _reference(q[r:r + 1], k_pool, v_pool, tables[r], lens[r:r + 1].long() - 1, window, scale)[0]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    out = torch.empty_like(q)
    paged_decode_attention(q, k_pool, v_pool, out, tables, lens, page_tokens=P, scale=scale, window=window)
    assert (out.double() - want).abs().max().item() <= tol
    # the window binds: the same rows without one are other outputs
    full = torch.empty_like(q)
    paged_decode_attention(q, k_pool, v_pool, full, tables, lens, page_tokens=P, scale=scale)
    assert (full[4].double() - want[4]).abs().max().item() > 10 * tol
    if dtype == torch.bfloat16:
        scratch = rows * nh * 4
        part_acc = torch.empty(scratch * d, device="cuda")
        part_m, part_l = torch.empty(scratch, device="cuda"), torch.empty(scratch, device="cuda")
        split = torch.empty_like(q)
        paged_decode_attention_split(q, k_pool, v_pool, split, tables, lens, part_acc, part_m, part_l, num_splits=4,
                                     page_tokens=P, scale=scale, window=window)
        assert (split.double() - want).abs().max().item() <= tol


@pytest.mark.parametrize("window", [7, 100])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_with_rope_equals_the_separate_kernels_with_a_window(window, splits):
    """The fused rotary + KV write + attention kernel with a window against fused.rope_write_kv followed by the
    windowed decode kernel checked above: the same outputs and the same K/V written."""
    from flared.model.kernels import fused
    from flared.model.triton_attention import paged_decode_attention, paged_decode_attention_rope

    nh, nkv, d = 8, 2, 64
    dtype = torch.bfloat16
    lens = torch.tensor([0, 1, 20, 70, 200], dtype=torch.int32, device="cuda")
    rows = lens.numel()
    tables = _tables(rows, seed=3)
    positions = (lens.long() - 1).clamp(min=0)
    slots = torch.stack([_slots(tables[r], positions[r:r + 1])[0] for r in range(rows)])
    slots[0] = NUM_PAGES * P  # the padding row writes the scratch page, which no row reads
    angles = torch.arange(512, device="cuda")[:, None] * 10000.0 ** (-torch.arange(d, device="cuda") % (d // 2) / d)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)  # any tables will do: both paths read the same ones
    qkv = torch.randn(rows, (nh + 2 * nkv) * d, device="cuda").to(dtype)
    scale = d ** -0.5
    k1, v1 = _pool(nkv, d, dtype, seed=11)
    k2, v2 = k1.clone(), v1.clone()
    q = torch.empty(rows, nh, d, device="cuda", dtype=dtype)
    fused.rope_write_kv(qkv, cos, sin, positions, slots, q, k1, v1, num_heads=nh, num_kv_heads=nkv, head_dim=d)
    want = torch.empty_like(q)
    paged_decode_attention(q, k1, v1, want, tables, lens, page_tokens=P, scale=scale, window=window)
    scratch = rows * nh * splits
    part_acc = torch.empty(scratch * d, device="cuda")
    part_m, part_l = torch.empty(scratch, device="cuda"), torch.empty(scratch, device="cuda")
    got = torch.empty_like(q)
    paged_decode_attention_rope(qkv, cos, sin, positions, slots, k2, v2, got, tables, lens, num_heads=nh,
                                page_tokens=P, scale=scale, num_splits=splits, part_acc=part_acc, part_m=part_m,
                                part_l=part_l, window=window)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert (got[1:].float() - want[1:].float()).abs().max().item() <= 2e-2


@pytest.mark.parametrize("window", [5, 40, 64, 100])
@pytest.mark.parametrize("dtype,split_mask", [(torch.float32, True), (torch.bfloat16, True),
                                              (torch.bfloat16, False)])
def test_prefill_kernel_sees_only_the_window(window, dtype, split_mask):
    """Packed chunks: one over a 30-token cached prefix, one from the start, one padding entry."""
    from flared.model.triton_attention import paged_prefill_attention_varlen

    nh, nkv, d = 8, 2, 64
    meta = torch.tensor([[30, 50], [0, 77], [0, 0]], dtype=torch.int32, device="cuda")
    tables = _tables(3, seed=window)
    k_pool, v_pool = _pool(nkv, d, dtype, seed=window + 1)
    capacity = 160
    q = torch.randn(capacity, nh, d, device="cuda").to(dtype)
    out = torch.full_like(q, 7.0)
    scale = d ** -0.5
    paged_prefill_attention_varlen(q, k_pool, v_pool, out, tables, meta, page_tokens=P, scale=scale,
                                   config={"split_mask": split_mask}, window=window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    row = 0
    for s, (cached, new) in enumerate(meta.tolist()):
        if not new:
            continue
        positions = torch.arange(cached, cached + new, device="cuda")
        want = _reference(q[row:row + new], k_pool, v_pool, tables[s], positions, window, scale)
        assert (out[row:row + new].double() - want).abs().max().item() <= tol, (s, window)
        row += new
    assert bool((out[row:] == 7.0).all())  # rows past the chunks are never written


def _tiny_mistral(dtype=torch.float32):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                        sliding_window=16, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                        pad_token_id=0)
    return MistralForCausalLM(cfg).eval().to(device="cuda", dtype=dtype)


def test_mistral_float32_greedy_tokens_match_transformers_and_the_cpu_path():
    """A random-weight Mistral with a 16-token window: prompts of 1 to 150 tokens (prefill chunks of 64/128 over
    cached pages), 24 new tokens each, through the GraphExecutor's graphs: tokens identical to the CPU path's and
    to transformers' generate."""
    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams

    hf = _tiny_mistral()
    model = serving_model(hf)
    assert model.config.sliding_window == 16
    prompts = [list(range(5, 155)), list(range(200, 210)), [7], list(range(300, 340))]
    params = [SamplingParams(max_tokens=24, temperature=0.0)] * len(prompts)
    ex = make_executor(model)
    try:
        assert ex.decoder.window == 16 and ex.decoder.mega_max_rows == 0
        got = drive(make_scheduler(), ex, prompts, params).tokens
    finally:
        ex.close()
    assert got == drive(make_scheduler(), make_cpu_executor(serving_model(hf, "cpu")), prompts, params).tokens
    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt], device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                          do_sample=False)
        assert out[0, len(prompt):].tolist() == tokens
    # the window changes the tokens here: the same weights without one give others
    hf.config.sliding_window = None
    unwindowed = serving_model(hf)
    assert unwindowed.config.sliding_window is None
    ex = make_executor(unwindowed)
    try:
        assert drive(make_scheduler(), ex, prompts, params).tokens != got
    finally:
        ex.close()


def test_mistral_bfloat16_graphs_serve_repeatably():
    """bf16: the fused forward with the windowed kernels (skinny kernels at few rows, split attention): greedy
    tokens repeat across drives and track the float32 executor's first tokens."""
    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams

    hf = _tiny_mistral()
    prompts = [list(range(5, 155)), list(range(300, 340))]
    params = [SamplingParams(max_tokens=16, temperature=0.0)] * len(prompts)
    ex = make_executor(serving_model(hf, dtype=torch.bfloat16))
    try:
        assert ex.decoder.fused and ex.decoder.window == 16
        first = drive(make_scheduler(), ex, prompts, params).tokens
        again = drive(make_scheduler(), ex, prompts, params).tokens
    finally:
        ex.close()
    assert first == again and all(len(t) == 16 for t in first)
    ex = make_executor(serving_model(hf))
    try:
        f32 = drive(make_scheduler(), ex, prompts, params).tokens
    finally:
        ex.close()
    assert sum(a[0] == b[0] for a, b in zip(first, f32)) >= 1
