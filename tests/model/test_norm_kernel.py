"""bf16 RMSNorm on the CPU (flared/_fast/norm.pyx): bit-exact with transformers' LlamaRMSNorm rounding."""

from __future__ import annotations

import pytest
import torch

norm = pytest.importorskip("flared._fast.norm")


def _llama_rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm.forward for a bf16 input."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(torch.bfloat16)


@pytest.mark.parametrize("rows, width", [(1, 576), (5, 100), (3, 4096), (2, 17)])
def test_bit_exact_with_transformers_rounding(rows, width):
    from flared.model.decoder import rms_norm

    g = torch.Generator().manual_seed(rows * width)
    x = (3 * torch.randn(rows, width, generator=g)).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(width, generator=g)).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-5), _llama_rms_norm(x, w, 1e-5))


def test_non_contiguous_rows_and_other_shapes_use_a_correct_path():
    from flared.model.decoder import rms_norm

    x = torch.randn(8, 64).to(torch.bfloat16)
    w = torch.ones(32, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(x[:, ::2], w, 1e-6), _llama_rms_norm(x[:, ::2].contiguous(), w, 1e-6))
    heads = torch.randn(4, 3, 32).to(torch.bfloat16)  # qk-norm shape, no weight: torch's op
    assert torch.allclose(rms_norm(heads, None, 1e-6).float(),
                          torch.nn.functional.rms_norm(heads.float(), (32,), None, 1e-6), atol=2e-2)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="empty"):
        norm.bf16_rms_norm(1, 1, 1, 0, 4, 1e-5)
    with pytest.raises(ValueError, match="null"):
        norm.bf16_rms_norm(0, 1, 1, 1, 4, 1e-5)
