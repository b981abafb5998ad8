"""llama.cpp's DRY, XTC and mirostat on the GPU (flared.model.sampling, as the executor's eager sampler runs them):
DRY's penalties equal the CPU's exactly, mirostat keeps its bound on the device, XTC's exclusions hold."""

import pytest

torch = pytest.importorskip("torch")

from flared.model.sampling import Sampler, SamplingParams  # noqa: E402

VOCAB = 1000


@pytest.mark.parametrize("restarts", [(), ((4, (3, 3)), (4, (3,)), (2, (1, 0, 1)))])
def test_dry_penalties_equal_the_cpu_s(restarts):
    """The same penalties on both devices; restart sequences (breakers several tokens spell) are compared at every
    position on the GPU, only at their heads on the CPU."""
    g = torch.Generator().manual_seed(0)
    history = torch.randint(0, 6, (300,), generator=g).tolist()
    params = SamplingParams(temperature=0, dry_multiplier=0.8, dry_breakers=frozenset({5}), dry_restarts=restarts,
                            max_tokens=4)
    rows = []
    for device in ("cpu", "cuda"):
        sampler = Sampler(VOCAB, device=device)
        state = sampler.add_sequence(params, history)
        rows.append(sampler.apply_bias_and_penalties(torch.zeros(1, VOCAB, device=device), [state])[0].cpu())
    assert torch.equal(rows[0], rows[1]) and (rows[0] < 0).sum() > 0


def test_mirostat_and_xtc_draw_on_the_device():
    logits = torch.full((1, VOCAB), -20.0, device="cuda")
    logits[0, :4] = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1], device="cuda"))
    sampler = Sampler(VOCAB, device="cuda")
    states = [sampler.add_sequence(SamplingParams(mirostat=2, mirostat_tau=1.0, mirostat_eta=0.5, seed=s), [])
              for s in range(16)]
    out = sampler.sample(logits.expand(16, VOCAB).contiguous(), states).token_ids
    assert set(out.tolist()) <= {0, 1}
    assert all(st.mirostat_mu.device.type == "cuda" and st.mirostat_mu.item() != 2.0 for st in states)
    states = [sampler.add_sequence(SamplingParams(xtc_probability=1.0, xtc_threshold=0.15, seed=s), [])
              for s in range(32)]
    out = sampler.sample(logits.expand(32, VOCAB).contiguous(), states).token_ids
    assert set(out.tolist()) <= {2, 3} | set(range(4, VOCAB)) and 2 in out.tolist()
