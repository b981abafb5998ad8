"""Rotary position tables.

``rope_tables`` precomputes cos/sin for every position the runner can reach,
once, so a forward only gathers rows by position. The frequencies follow
transformers exactly (same float32 arithmetic), including Llama 3's
wavelength-dependent scaling, plain linear scaling, YaRN and LongRoPE (whose
attention factors scale the tables, as transformers scales cos and sin) and
llama.cpp's per-frequency divisors; other rope types never reach here
(``ModelConfig`` refuses them). Partial rotary embeddings make the tables
``rotary_dim`` wide: only that many of each head's dimensions turn.
"""

from __future__ import annotations

import math

import torch

from flared.model.config import ModelConfig


def longrope_is_long(scaling: dict, context: int | None) -> bool:
    """Whether LongRoPE's long factors turn a core serving ``context`` tokens: where it passes the original context
    (one table for the whole context, as vLLM and llama.cpp choose it)."""
    return context is not None and context > scaling["original_max_position_embeddings"]


def inverse_frequencies(config: ModelConfig, *, local: bool = False, context: int | None = None) -> torch.Tensor:
    """[rope_dim // 2] float32 (Gemma 4's global layers: [global_head_dim // 2]). ``local``: the windowed layers' plain
    rope at local_rope_theta (Gemma 3). ``context``: the longest sequence served (LongRoPE takes its long factors where
    it passes the original context)."""
    dim = config.rope_dim if local or not config.global_head_dim else config.global_head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    powers = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / powers
    scaling = None if local else config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] in ("longrope", "factors"):
        if scaling["rope_type"] == "factors":
            table = scaling["factors"]
        else:
            table = scaling["long_factor" if longrope_is_long(scaling, context) else "short_factor"]
        return 1.0 / (torch.tensor(table, dtype=torch.float32) * powers)
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "proportional":  # the first pairs turn, the others stand still (as transformers)
        turning = int(scaling["partial_rotary_factor"] * dim // 2)
        return torch.cat([inv_freq[:turning], torch.zeros(dim // 2 - turning)])
    if scaling["rope_type"] == "yarn":
        return _yarn_frequencies(inv_freq, dim, theta, scaling)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_frequencies(inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated (slowed
    by ``factor``), those that turn more than beta_fast times kept, a linear ramp between."""
    original = scaling["original_max_position_embeddings"]

    def dimension(rotations: float) -> float:  # the dimension whose frequency turns ``rotations`` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling["beta_fast"]), dimension(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)  # as transformers rounds it
    return 1.0 / (scaling["factor"] * pos_freqs) * (1 - keep) + inv_freq * keep


def rope_tables(config: ModelConfig, num_positions: int, *, dtype: torch.dtype,
                device: torch.device | str, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [num_positions, rope_dim] in ``dtype``; halves repeated
    for the rotate-half layout. ``num_positions`` is the longest sequence served."""
    inv_freq = inverse_frequencies(config, local=local, context=num_positions)
    positions = torch.arange(num_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    scaling = None if local else config.rope_scaling
    if scaling is not None and scaling["rope_type"] in ("yarn", "longrope"):
        cos, sin = cos * scaling["attention_factor"], sin * scaling["attention_factor"]
    return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)
