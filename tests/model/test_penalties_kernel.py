"""flared._fast.penalties.apply_penalties, the CPU Sampler's repetition, frequency and presence penalties in one
pass a row: the same bits as the torch expressions it replaced (Sampler._apply_penalties' GPU path), on rows with
positive, negative, zero, infinite and NaN logits, counts from 0 to 3, prompt tokens, and penalties on either side
of neutral."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flared._fast.penalties import apply_penalties  # noqa: E402
from flared.model.sampling import Sampler, SamplingParams  # noqa: E402


def _torch_reference(logits, counts, prompt, rows, slots, rep, freq, pres):
    """Sampler._apply_penalties' torch form (what a GPU's eager rows run)."""
    out = logits.clone()
    counts = counts[slots]
    seen_in_output = counts > 0
    seen = seen_in_output | prompt[slots]
    sub = out[rows]
    penalised = torch.where(sub > 0, sub / rep[:, None], sub * rep[:, None])
    sub = torch.where(seen, penalised, sub)
    sub = sub - freq[:, None] * counts.to(sub.dtype) - pres[:, None] * seen_in_output.to(sub.dtype)
    out[rows] = sub
    return out


@pytest.mark.parametrize("vocab", [1, 7, 49152])
def test_the_same_bits_as_the_torch_penalties(vocab):
    g = torch.Generator().manual_seed(vocab)
    batch, slots = 6, 5
    logits = torch.randn(batch, vocab, generator=g) * 4
    logits[:, ::11] = 0.0
    logits[1, ::13] = float("-inf")
    logits[2, ::17] = float("nan")
    logits[3, ::19] = float("inf")
    counts = torch.randint(0, 4, (slots, vocab), generator=g, dtype=torch.int32)
    counts[counts == 1] = 0  # more tokens never counted
    prompt = torch.rand(slots, vocab, generator=g) < 0.2
    rows = torch.tensor([0, 1, 2, 3, 5])  # row 4 takes no penalty
    which = torch.tensor([4, 0, 2, 1, 3])
    rep = torch.tensor([1.3, 0.7, 2.0, 1.0, 1.1])
    freq = torch.tensor([0.5, -0.5, 0.0, 1.5, 0.25])
    pres = torch.tensor([0.25, 1.0, -1.0, 0.0, 0.5])
    want = _torch_reference(logits, counts, prompt, rows, which, rep, freq, pres)
    got = logits.clone()
    apply_penalties(got.numpy(), counts.numpy(), prompt.numpy().view(np.uint8), rows.numpy(), which.numpy(),
                    rep.numpy(), freq.numpy(), pres.numpy())
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got[4], logits[4])


def test_bad_arguments_are_refused():
    logits = np.zeros((2, 8), dtype=np.float32)
    counts, prompt = np.zeros((3, 8), dtype=np.int32), np.zeros((3, 8), dtype=np.uint8)
    one = np.ones(1, dtype=np.float32)
    with pytest.raises(ValueError, match="out of range"):
        apply_penalties(logits, counts, prompt, np.array([2]), np.array([0]), one, one, one)
    with pytest.raises(ValueError, match="out of range"):
        apply_penalties(logits, counts, prompt, np.array([0]), np.array([3]), one, one, one)
    with pytest.raises(ValueError, match="columns"):
        apply_penalties(logits, np.zeros((3, 9), dtype=np.int32), prompt, np.array([0]), np.array([0]), one, one,
                        one)


def test_the_cpu_sampler_draws_as_before_with_penalties():
    """A CPU Sampler's penalised rows (vLLM's and llama.cpp's windowed) equal the torch form's, so greedy tokens
    over 40 steps are those of the torch path (which logits that are not contiguous take)."""
    vocab = 64
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.8, presence_penalty=0.4, frequency_penalty=0.3,
                             max_tokens=60),
              SamplingParams(temperature=0.0, repetition_penalty=2.5, penalty_last_n=5, max_tokens=60)]
    fast, slow = Sampler(vocab, max_penalty_slots=2), Sampler(vocab, max_penalty_slots=2)
    prompt = [3, 4, 5, 3]
    a = [fast.add_sequence(p, prompt) for p in params]
    b = [slow.add_sequence(p, prompt) for p in params]
    g = torch.Generator().manual_seed(0)
    for step in range(40):
        logits = torch.randn(2, vocab, generator=g) + torch.linspace(3.0, 0.0, vocab)
        strided = logits.t().contiguous().t()  # the same values, column-major
        assert not strided.is_contiguous()
        got = fast.apply_bias_and_penalties(logits, a)
        want = slow.apply_bias_and_penalties(strided, b)
        assert not want.is_contiguous() and torch.equal(got, want), step
        tokens = fast.sample(logits, a).token_ids
        assert torch.equal(tokens, slow.sample(strided, b).token_ids), step
