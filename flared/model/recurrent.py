"""Recurrent layers' state per sequence (Qwen3-Next's and Qwen3.5's Gated DeltaNet, LFM2's short convolutions,
Granite 4.0-H's Mamba-2, Jamba's Mamba-1), and their scans.

A Gated DeltaNet layer keeps no keys and values. Each sequence has, per such layer:
- a state matrix S [value_heads, key_dim, value_dim] (float32), which every token decays by exp(g) and then
  corrects toward that token's value (the delta rule: S += k (beta (v - S^T k))^T), and which the token's query
  reads (o = S^T q);
- the last ``kernel - 1`` inputs of the causal depthwise convolution over q, k and v (the model's dtype).

An LFM2 short-convolution layer keeps only its convolution's last ``kernel - 1`` inputs (hidden wide). A Mamba-2
layer (Granite 4.0-H) keeps a state per head too, [state size, head channels], decayed by exp(dt A) and fed
dt x B^T every token and read by C: linear attention with a decay and no delta rule (``chunked_linear_attention``,
``linear_attention_step``), B and C as its keys and queries, dt x as its values. A Mamba-1 layer (Jamba) keeps a state
per channel, [state size], decayed per state by exp(dt A) (its own decay for each channel and state, so no scalar
decay per head: ``chunked_selective_scan``, ``selective_step``).

``RecurrentState`` holds these for a fixed number of *state rows*. A row is a sequence's for its life: the eager
executor gives each live request's state row (and each prefix-cache snapshot) one, zeroes it when a request starts
(the scheduler's INITIALIZE step), and copies rows to and from snapshots as it copies a partial KV page, so a prefix
taken from the cache resumes from the exact state its endpoint had. A sequence's row must hold the state after
exactly the tokens the KV cache holds for it: a forward that feeds a sequence tokens advances its row past them.

Prefill chunks run the chunked form (``chunked_gated_delta``: 64 tokens at a time as products, the state carried
between chunks); decode rows one recurrent step each, batched over the rows (``gated_delta_step``). Both follow
transformers' torch reference (float32 throughout, q and k L2-normed, q scaled by key_dim ** -0.5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flared.model.config import ModelConfig

CHUNK_TOKENS = 64


class RecurrentState:
    def __init__(self, config: ModelConfig, rows: int, *, dtype: torch.dtype, device: torch.device | str = "cpu"):
        """``rows`` state rows for every recurrent layer of ``config``; ``dtype``: the convolution inputs' (the
        model's). Rows start zeroed (a fresh sequence's state)."""
        if rows <= 0:
            raise ValueError(f"a recurrent state needs at least one row, got {rows}")
        c = config
        self.rows = rows
        self.layer_index = {layer: j for j, layer in enumerate(c.linear_layers)}
        n = len(c.linear_layers)
        self.conv = torch.zeros(n, rows, c.linear_conv_dim, c.linear_conv_kernel - 1, dtype=dtype, device=device)
        self.ssm = None if c.short_conv else torch.zeros(n, rows, c.linear_value_heads, c.linear_key_dim,
                                                         c.linear_value_dim, dtype=torch.float32, device=device)

    @property
    def num_bytes(self) -> int:
        tensors = (self.conv,) if self.ssm is None else (self.conv, self.ssm)
        return sum(t.numel() * t.element_size() for t in tensors)

    def reset(self, rows) -> None:
        """Zero ``rows`` (a sequence starting from nothing)."""
        index = torch.as_tensor(rows, dtype=torch.int64, device=self.conv.device).reshape(-1)
        self.conv.index_fill_(1, index, 0)
        if self.ssm is not None:
            self.ssm.index_fill_(1, index, 0)

    def copy(self, source: int, destination: int) -> None:
        """Row ``destination`` becomes a copy of row ``source`` (a snapshot taken or restored)."""
        self.conv[:, destination] = self.conv[:, source]
        if self.ssm is not None:
            self.ssm[:, destination] = self.ssm[:, source]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def prepare(q: torch.Tensor, k: torch.Tensor, value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., key_heads, key_dim] -> float32 [..., value_heads, key_dim]: each key head repeated for its value
    heads, L2-normed, q scaled by key_dim ** -0.5."""
    q, k = _l2norm(q.float()), _l2norm(k.float())
    repeat = value_heads // q.shape[-2]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
    return q * q.shape[-1] ** -0.5, k


def gated_delta_step(q, k, v, g, beta, state):
    """One token for each of B sequences: q, k [B, nv, dk] (prepared), v [B, nv, dv], g, beta [B, nv] (float32),
    state [B, nv, dk, dv] float32 (updated in place) -> the outputs [B, nv, dv] float32."""
    state.mul_(g.exp()[..., None, None])
    remembered = torch.einsum("bhkv,bhk->bhv", state, k)
    delta = (v.float() - remembered) * beta[..., None]
    state.add_(k[..., :, None] * delta[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)


def _chunks(q, k, v, *per_token):
    """A sequence's [L, heads, d] q, k, v and [L, heads] per-token values (the log decays first) as float32 chunks of
    CHUNK_TOKENS (zero-padded: a padded token neither decays nor writes): [heads, N, C, d] and [heads, N, C]; and the
    decays within each chunk, cum (the log decay from the chunk's start, [heads, N, C]) and exp(cum_t - cum_s) for
    s <= t ([heads, N, C, C], 0 above the diagonal)."""
    size = CHUNK_TOKENS
    pad = -q.shape[0] % size
    heads = q.shape[1]
    q, k, v = (F.pad(x.float().transpose(0, 1), (0, 0, 0, pad)).reshape(heads, -1, size, x.shape[-1])
               for x in (q, k, v))
    per_token = [F.pad(x.float().transpose(0, 1), (0, pad)).reshape(heads, -1, size) for x in per_token]
    cum = per_token[0].cumsum(dim=-1)
    upper = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    return q, k, v, per_token[1:], cum, decay


def _unchunk(out: torch.Tensor, length: int) -> torch.Tensor:
    """[heads, N, C, d] chunks back to a sequence's [length, heads, d]."""
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :length].transpose(0, 1)


def chunked_gated_delta(q, k, v, g, beta, state):
    """One sequence's L tokens: q, k [L, nv, dk] (prepared), v [L, nv, dv], g, beta [L, nv] (float32), state [nv, dk,
    dv] float32 (replaced in place by the state after the L tokens) -> the outputs [L, nv, dv] float32. CHUNK_TOKENS
    tokens at a time: within a chunk the delta rule's updates are solved as one triangular system (the UT transform)
    and read as a masked product; the state carries the chunks before it."""
    length = q.shape[0]
    q, k, v, (beta,), cum, decay = _chunks(q, k, v, g, beta)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [nv, N, 1, 1]
    out = torch.empty_like(values)
    s = state
    for i in range(values.shape[1]):
        fresh = values[:, i] - k_decayed[:, i] @ s
        out[:, i] = q[:, i] @ s + inner[:, i] @ fresh
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ fresh
    state.copy_(s)
    return _unchunk(out, length)


def linear_attention_step(q, k, v, g, state):
    """One token for each of B sequences, without the delta rule (Mamba-2): q, k [B, h, dk], v [B, h, dv], g [B, h]
    (float32), state [B, h, dk, dv] float32 (updated in place: exp(g) S + k v^T) -> the outputs S^T q [B, h, dv]."""
    state.mul_(g.exp()[..., None, None])
    state.add_(k[..., :, None] * v[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)


def chunked_linear_attention(q, k, v, g, state):
    """One sequence's L tokens without the delta rule (Mamba-2's state space duality): q, k [L, h, dk], v [L, h, dv],
    g [L, h] (float32 log decays), state [h, dk, dv] float32 (replaced in place by the state after the L tokens) ->
    [L, h, dv]: o_t = sum over s <= t of exp(g_s+1 + ... + g_t) (q_t . k_s) v_s, plus the decayed state read by q_t.
    CHUNK_TOKENS tokens at a time as products, the state carried between chunks."""
    length = q.shape[0]
    q, k, v, _, cum, decay = _chunks(q, k, v, g)
    inner = (q @ k.transpose(-1, -2)) * decay
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    s = state
    for i in range(v.shape[1]):
        out[:, i] = inner[:, i] @ v[:, i] + q[:, i] @ s
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v[:, i]
    state.copy_(s)
    return _unchunk(out, length)


def selective_step(u, b, c, log_decay, state):
    """One token for each of B sequences of a Mamba-1 layer (Jamba's): u [B, C] (dt x), b, c [B, N] (shared by the
    channels), log_decay [B, C, N] (dt A), state [B, C, N] float32 (updated in place: exp(dt A) S + u b^T) -> the outputs
    S c [B, C] float32."""
    state.mul_(log_decay.exp()).add_(u[:, :, None] * b[:, None, :])
    return torch.einsum("bcn,bn->bc", state, c)


def chunked_selective_scan(u, b, c, log_decay, state, *, block: int = 64):
    """One sequence's L tokens of a Mamba-1 layer: u [L, C] (dt x), b, c [L, N], log_decay [L, C, N] (dt A, each
    channel's and state's own, float32), state [C, N] float32 (replaced in place by the state after the L tokens) ->
    [L, C]: y_t = S_t c_t with S_t = exp(dt_t A) S_t-1 + u_t b_t^T. ``block`` tokens at a time: their decays and
    inputs as products, the recurrence a token at a time over the block (each channel and state decays at its own
    rate, so the chunked form of a scalar decay's scan does not apply: its intra-chunk weights would cost a chunk's
    length in exponentials per token), the block's states read by c at once."""
    length, channels, _ = log_decay.shape
    out = torch.empty(length, channels, dtype=torch.float32, device=u.device)
    for lo in range(0, length, block):
        hi = min(lo + block, length)
        decay = log_decay[lo:hi].exp()  # [l, C, N], then each token's state in its place
        feed = u[lo:hi, :, None].float() * b[lo:hi, None, :].float()
        for i in range(hi - lo):
            state.mul_(decay[i]).add_(feed[i])
            decay[i] = state
        out[lo:hi] = torch.einsum("tcn,tn->tc", decay, c[lo:hi].float())
    return out


def channel_delta_step(q, k, v, g, beta, state):
    """One token for each of B sequences of a Kimi Delta Attention layer: Gated DeltaNet's step with a decay per key
    channel: q, k [B, h, dk] (prepared), v [B, h, dv], g [B, h, dk] (log decays), beta [B, h] (float32), state [B, h, dk,
    dv] float32 (updated in place) -> the outputs [B, h, dv] float32."""
    state.mul_(g.exp()[..., None])
    remembered = torch.einsum("bhkv,bhk->bhv", state, k)
    delta = (v.float() - remembered) * beta[..., None]
    state.add_(k[..., :, None] * delta[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)


def chunked_channel_delta(q, k, v, g, beta, state, *, chunk: int = 32):
    """One sequence's L tokens of a Kimi Delta Attention layer: q, k [L, h, dk] (prepared), v [L, h, dv], g [L, h, dk]
    (log decays, each key channel its own), beta [L, h] (float32), state [h, dk, dv] float32 (replaced in place by the
    state after the L tokens) -> [L, h, dv] float32. ``chunk`` tokens at a time, as chunked_gated_delta but with the
    decays between two tokens of a chunk a vector (exp(cum_t - cum_s) per key channel, [h, N, C, C, dk]: no factoring
    it into products of exp(cum_t) and exp(-cum_s), which overflow)."""
    length, heads = q.shape[0], q.shape[1]
    pad = -length % chunk

    def chunks(x):  # [L, h, d] -> [h, N, C, d] float32, zero-padded (a padded token neither decays nor writes)
        return F.pad(x.float().transpose(0, 1), (0, 0, 0, pad)).reshape(heads, -1, chunk, x.shape[-1])

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    beta = F.pad(beta.float().transpose(0, 1), (0, pad)).reshape(heads, -1, chunk)
    cum = g.cumsum(dim=2)  # [h, N, C, dk]: the log decay from the chunk's start through t
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)[..., None]
    decay = (cum[:, :, :, None] - cum[:, :, None]).masked_fill(upper, float("-inf")).exp()  # [h, N, t, s, dk]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = torch.einsum("hntd,hnsd,hntsd->hnts", k_beta, k, decay)
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * cum.exp(), upper=False, unitriangular=True)
    inner = torch.einsum("hntd,hnsd,hntsd->hnts", q, k, decay)
    del decay
    q = q * cum.exp()
    k = k * (cum[:, :, -1:] - cum).exp()
    chunk_decay = cum[:, :, -1].exp()[..., None]  # [h, N, dk, 1]
    out = torch.empty_like(values)
    s = state
    for i in range(values.shape[1]):
        fresh = values[:, i] - k_decayed[:, i] @ s
        out[:, i] = q[:, i] @ s + inner[:, i] @ fresh
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ fresh
    state.copy_(s)
    return _unchunk(out, length)
