"""The CUDA decode attention's builds (kernels/decode_attention.py), checked without a GPU: which attention
shapes it takes and what it says about the others."""

import pytest

torch = pytest.importorskip("torch")

from flared.model.kernels.decode_attention import Build, default_build, unsupported  # noqa: E402


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 128), (9, 3, 64), (28, 4, 128), (32, 32, 128),
                                                       (64, 8, 128), (15, 5, 64), (14, 2, 64)])
def test_real_shapes_get_a_build(heads, kv_heads, head_dim):
    assert unsupported(heads, kv_heads, head_dim, torch.bfloat16) is None
    b = default_build(heads // kv_heads, head_dim, 16)
    assert b.defines() == {"GROUP": heads // kv_heads, "D": head_dim, "PAGE": 16, "PREFETCH": b.prefetch,
                           "BLOCKS_PER_SM": b.blocks_per_sm}


def test_what_it_cannot_run_says_why():
    assert "bf16" in unsupported(32, 8, 128, torch.float16)
    assert "bf16" in unsupported(32, 8, 128, torch.float32)
    assert "head dim" in unsupported(32, 8, 96, torch.bfloat16)
    assert "at most 8" in unsupported(128, 8, 128, torch.bfloat16)
    assert "query heads" in unsupported(30, 8, 128, torch.bfloat16)
    assert "multiple of 16" in unsupported(32, 8, 128, torch.bfloat16, page_tokens=8)
    with pytest.raises(ValueError, match="multiple of 16"):
        Build(4, 128, 8)
    with pytest.raises(ValueError):
        Build(4, 128, 16, prefetch=2)
