"""graph_layers.ImageBlocks: Gemma 3's images attended again after the graphs' causal paged prefill kernel, in an
eager run of the prefill forward. Checked against a dense float64 attention under transformers' mask for such
images (a full layer: causal or the same image; a windowed one: that, and the key inside the window), for packed
sequences with cached prefixes, grouped heads, a window shorter than an image, a soft cap and sinks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from flared.model.graph_layers import ImageBlocks  # noqa: E402

PAGE = 4
IMAGE = 99
VIDEO = 98


def _dense(q, keys, values, qpos, kpos, qgroup, kgroup, window, scale, softcap=0.0, sinks=None):
    """One sequence's rows: q [n, nh, d] at qpos over keys/values [L, nkv, d] at kpos, float64; ``qgroup``/
    ``kgroup``: each row's image (-1: text)."""
    nh, nkv = q.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(nh // nkv, 1)
    v = values.double().repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    same = (qgroup[:, None] == kgroup[None, :]) & (qgroup[:, None] >= 0)
    allowed = (kpos[None, :] <= qpos[:, None]) | same
    if window:
        allowed &= kpos[None, :] > qpos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.double().view(nh, 1, 1).expand(nh, scores.shape[1], 1)), -1)
        return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1)[..., :-1], v)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


def _groups(ids):
    """Each position's image (a run of IMAGE tokens), -1 for text."""
    out, current, last = [], -1, False
    for t in ids:
        image = t == IMAGE
        if image and not last:
            current += 1
        out.append(current if image else -1)
        last = image
    return torch.tensor(out)


@pytest.mark.parametrize("window,softcap,with_sinks", [(0, 0.0, False), (5, 0.0, False), (0, 30.0, True),
                                                       (3, 0.0, True)])
def test_image_rows_match_the_dense_mask(window, softcap, with_sinks):
    g = torch.Generator().manual_seed(7)
    nh, nkv, d = 4, 2, 8
    # Two packed sequences: the first with 6 cached tokens and a chunk of text, an image, text, a second image;
    # the second with no cache, text then an image that ends the chunk. A third padding sequence.
    seqs = [[1, 2, 3, 4, 5, 6] + [7, 8] + [IMAGE] * 7 + [9, 10] + [IMAGE] * 3 + [11],
            [12, 13, 14] + [IMAGE] * 6]
    cached = [6, 0]
    pages_per = 8
    num_slots = (len(seqs) + 1) * pages_per * PAGE
    k_pool = torch.randn(num_slots, nkv, d, generator=g)
    v_pool = torch.randn(num_slots, nkv, d, generator=g)
    perm = torch.randperm(len(seqs) * pages_per, generator=g).int()
    tables = torch.zeros(3, pages_per, dtype=torch.int32)
    tables[:2] = perm.view(2, pages_per)
    meta = torch.tensor([[cached[0], len(seqs[0]) - cached[0]], [0, len(seqs[1])], [0, 0]], dtype=torch.int32)
    chunk = [t for s, c in zip(seqs, cached) for t in s[c:]]
    capacity = len(chunk) + 5  # (padding rows past the chunks)
    tokens = torch.tensor(chunk + [0] * 5)
    q = torch.randn(capacity, nh, d, generator=g)
    sinks = torch.randn(nh, generator=g) if with_sinks else None
    scale = 0.3

    def slots_of(s, n):
        pos = torch.arange(n)
        return tables[s, pos // PAGE].long() * PAGE + pos % PAGE

    want = torch.zeros(capacity, nh, d, dtype=torch.float64)
    causal = torch.full((capacity, nh, d), 5.0)  # (what the causal kernel wrote: the text rows' answer)
    row = 0
    for s, ids in enumerate(seqs):
        n = len(ids)
        slots = slots_of(s, n)
        groups = _groups(ids)
        qpos = torch.arange(cached[s], n)
        rows = slice(row, row + len(qpos))
        want[rows] = _dense(q[rows], k_pool[slots], v_pool[slots], qpos, torch.arange(n), groups[qpos], groups,
                            window, scale, softcap, sinks)
        text = groups[qpos] < 0
        causal[rows][text] = _dense(q[rows], k_pool[slots], v_pool[slots], qpos, torch.arange(n),
                                    torch.full((len(qpos),), -1), torch.full((n,), -1), window, scale, softcap,
                                    sinks)[text].float()
        row += len(qpos)

    blocks = ImageBlocks(tokens, meta, tables, (IMAGE,), PAGE)
    assert [(r[3], r[4]) for r in blocks.runs] == [(8, 15), (17, 20), (3, 9)]
    calls = []

    def kernel(q_, layer, out, window=None, sinks=None, softcap=0.0, geometry=None, alibi=None, latent=0):
        calls.append((layer, window))
        out.copy_(causal)

    attend = blocks.wrap(kernel, lambda layer, geometry: (k_pool, v_pool), default_window=window, scale=scale)
    out = torch.zeros(capacity, nh, d)
    attend(q, 3, out, sinks=sinks, softcap=softcap)
    assert calls == [(3, None)]
    image = tokens == IMAGE
    assert torch.allclose(out[:len(chunk)].double(), want[:len(chunk)], atol=1e-5)
    assert torch.equal(out[~image], causal[~image])  # (text and padding rows as the kernel left them)
    # The image rows differ from the causal answer: their later image keys count.
    causal_image = torch.zeros(capacity, nh, d, dtype=torch.float64)
    row = 0
    for s, ids in enumerate(seqs):
        n = len(ids)
        slots = slots_of(s, n)
        qpos = torch.arange(cached[s], n)
        causal_image[row:row + len(qpos)] = _dense(q[row:row + len(qpos)], k_pool[slots], v_pool[slots], qpos,
                                                   torch.arange(n), torch.full((len(qpos),), -1),
                                                   torch.full((n,), -1), window, scale, softcap, sinks)
        row += len(qpos)
    assert (out[image].double() - causal_image[image]).abs().max() > 1e-2


def test_a_chunk_without_images_keeps_the_kernel():
    meta = torch.tensor([[0, 3]], dtype=torch.int32)
    blocks = ImageBlocks(torch.tensor([1, 2, 3]), meta, torch.zeros(1, 2, dtype=torch.int32), (IMAGE,), PAGE)

    def kernel(*args, **kw):
        pass

    assert blocks.wrap(kernel, None, 0, 1.0) is kernel


def test_latent_or_alibi_layers_are_refused():
    meta = torch.tensor([[0, 2]], dtype=torch.int32)
    blocks = ImageBlocks(torch.tensor([IMAGE, IMAGE]), meta, torch.zeros(1, 2, dtype=torch.int32), (IMAGE,), PAGE)
    attend = blocks.wrap(lambda *a, **k: None, None, 0, 1.0)
    with pytest.raises(ValueError, match="ALiBi"):
        attend(torch.zeros(2, 1, 4), 0, torch.zeros(2, 1, 4), alibi=torch.zeros(1))


def test_gemma4_attends_both_ways_on_windowed_layers_only():
    """Gemma 4's mask (26B-A4B, 31B): an image's or a video frame's tokens both ways on the windowed layers, the
    global layers (window 0) causal: the kernel's answer kept."""
    g = torch.Generator().manual_seed(3)
    ids = [1, 2] + [IMAGE] * 4 + [3] + [VIDEO] * 3 + [4]
    meta = torch.tensor([[0, len(ids)]], dtype=torch.int32)
    tables = torch.arange(4, dtype=torch.int32).view(1, 4)
    blocks = ImageBlocks(torch.tensor(ids), meta, tables, (IMAGE, VIDEO), PAGE, windowed_only=True)
    assert [(r[3], r[4]) for r in blocks.runs] == [(2, 6), (7, 10)]
    k_pool, v_pool = torch.randn(16, 1, 8, generator=g), torch.randn(16, 1, 8, generator=g)
    q = torch.randn(len(ids), 2, 8, generator=g)
    causal = torch.full((len(ids), 2, 8), 5.0)

    def kernel(q_, layer, out, window=None, sinks=None, softcap=0.0, geometry=None, alibi=None, latent=0):
        out.copy_(causal)

    attend = blocks.wrap(kernel, lambda layer, geometry: (k_pool, v_pool), default_window=0, scale=0.5)
    out = torch.zeros_like(causal)
    attend(q, 0, out, window=0)
    assert torch.equal(out, causal)
    attend(q, 0, out, window=6)
    moved = (out != causal).any(-1).any(-1)
    assert moved.tolist() == [t in (IMAGE, VIDEO) for t in ids]
