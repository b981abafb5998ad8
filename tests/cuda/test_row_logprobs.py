"""Log-probabilities of drawn tokens on the GPU (flared/model/kernels/sampling.py's row_logprobs): the chosen
token's log-softmax and the top n, against torch's log_softmax and a stable sort, on rows whose n-th largest logit
the lane maxima bound (the usual path) and on flat and tied rows (the four-pass select)."""

import pytest

torch = pytest.importorskip("torch")


def _run(logits, rows, picks, sampled, top_n):
    """row_logprobs over args of capacity len(rows) + 2 (two padding rows): [(chosen, [(id, logprob)])] a row."""
    from flared.model.kernels.sampling import GRAPH_LOGPROBS, LogprobScratch, row_logprobs

    cap = len(rows) + 2
    dev = logits.device
    args = torch.full((3, cap), -1, dtype=torch.int64, device=dev)
    args[0, :len(rows)] = torch.tensor(rows)
    args[1, :len(rows)] = torch.tensor(picks)
    args[2, :len(rows)] = torch.tensor(top_n)
    args[0, len(rows):] = 0
    args[1, len(rows):] = 0
    out = torch.full((cap, 1 + 2 * GRAPH_LOGPROBS), 123.0, dtype=torch.float32, device=dev)
    row_logprobs(logits, args, sampled, out, LogprobScratch(cap, logits.shape[1], dev))
    host = out.cpu()
    ids = host.view(torch.int32)
    got = []
    for r, n in enumerate(top_n):
        top = [(int(ids[r, 1 + GRAPH_LOGPROBS + j]), float(host[r, 1 + j])) for j in range(n)]
        got.append((float(host[r, 0]), top))
    assert torch.all(host[len(rows):] == 123.0), "padding rows were written"
    return got


def _expected(logits, rows, picks, sampled, top_n):
    want = []
    for row, pick, n in zip(rows, picks, top_n):
        lp = torch.log_softmax(logits[row].double(), dim=-1)
        # larger first, the smaller id first among equal logits (a stable sort of the negated logits)
        order = torch.sort(-logits[row].double(), stable=True).indices[:n]
        want.append((float(lp[sampled[pick]]), [(int(i), float(lp[i])) for i in order]))
    return want


def _check(got, want):
    for (chosen, top), (w_chosen, w_top) in zip(got, want):
        assert chosen == pytest.approx(w_chosen, abs=2e-5)
        assert [i for i, _ in top] == [i for i, _ in w_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in w_top], abs=2e-5)


@pytest.mark.parametrize("vocab", [100, 5000, 49152, 128256])
def test_chosen_and_top_logprobs_equal_torch_s(vocab):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(vocab)
    logits = torch.randn(7, vocab, device=dev, generator=g) * 3
    sampled = torch.randint(0, vocab, (9,), device=dev, generator=g)
    rows, picks = [3, 0, 6, 2, 5], [8, 1, 0, 4, 2]
    top_n = [0, 1, 5, 20, min(32, vocab)]
    _check(_run(logits, rows, picks, sampled, top_n), _expected(logits, rows, picks, sampled.tolist(), top_n))


def test_flat_and_tied_rows_take_the_smaller_ids_first():
    """A flat row (every logit equal: the copy above the lane maxima's bound overflows), a row whose 5th largest is
    shared by thousands of tokens (the same), one with a few ties among its largest (the copy's path, ranked at
    once) and one whose largest 300 are equal (the copy's path, a reduction a top logprob)."""
    dev = "cuda"
    vocab = 49152
    logits = torch.zeros(4, vocab, device=dev)
    g = torch.Generator(device=dev).manual_seed(1)
    logits[1] = torch.where(torch.rand(vocab, device=dev, generator=g) < 0.5, 1.0, -2.0)
    logits[1, [40000, 7, 31000]] = torch.tensor([5.0, 4.0, 4.0], device=dev)
    logits[2] = torch.randn(vocab, device=dev, generator=g)
    logits[2, [9000, 12, 30000, 4]] = 6.0
    logits[3] = torch.randn(vocab, device=dev, generator=g)
    logits[3, 100:vocab:163] = 7.0
    sampled = torch.tensor([17, 40000, 9000, 263], device=dev)
    rows, picks, top_n = [0, 1, 2, 3], [0, 1, 2, 3], [5, 8, 6, 32]
    got = _run(logits, rows, picks, sampled, top_n)
    _check(got, _expected(logits, rows, picks, sampled.tolist(), top_n))
    assert [i for i, _ in got[0][1]] == [0, 1, 2, 3, 4]
    assert [i for i, _ in got[2][1]][:4] == [4, 12, 9000, 30000]
    assert [i for i, _ in got[3][1]] == list(range(100, 100 + 32 * 163, 163))
