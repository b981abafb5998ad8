"""The decoder forward over a ``ForwardBatch`` and a ``PagedKVCache``.

``DecoderModel.forward(batch, kv)`` runs every new token of every sequence in
one pass and returns float32 logits for ``batch.logit_row_ids`` only. Shapes
below: T = new tokens in the batch, H = hidden size, nh/nkv = query/kv heads,
d = head dim.

Rules:
- No Python work per sequence except one attention call per prefill chunk;
  decode rows share one batched attention per layer, reading the paged cache
  through a single gather per layer.
- No host<->device sync inside the forward: every index it needs was built by
  ``ForwardBatch.build`` before it runs.
- The arithmetic order of RMSNorm, rope and attention follows transformers so
  float32 runs match it to rounding; softmax runs in float32 for any dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flared.model.batch import ForwardBatch
from flared.model.config import ModelConfig
from flared.model.kv_cache import PagedKVCache
from flared.model.loader import check_serving_tensors
from flared.model.rope import rope_tables


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm: statistics in float32, scale applied after casting back.
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layer:
    __slots__ = ("attn_norm", "qkv_w", "qkv_b", "q_norm", "k_norm", "o_w", "o_b", "mlp_norm", "gate_up_w", "down_w")


class DecoderModel:
    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_positions: int | None = None):
        check_serving_tensors(tensors, config, source="serving tensors")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_positions = max_positions or config.max_position_embeddings

        def w(name: str) -> torch.Tensor:
            return tensors[name].to(device=self.device, dtype=dtype).contiguous()

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in tensors else None

        self.embed = w("embed.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else w("lm_head.weight")
        self.final_norm = w("final_norm.weight")
        self.layers: list[_Layer] = []
        for i in range(config.num_layers):
            p = f"layers.{i}."
            layer = _Layer()
            layer.attn_norm = w(p + "attn_norm.weight")
            layer.qkv_w = w(p + "qkv.weight")
            layer.qkv_b = opt(p + "qkv.bias")
            layer.q_norm = opt(p + "q_norm.weight")
            layer.k_norm = opt(p + "k_norm.weight")
            layer.o_w = w(p + "o.weight")
            layer.o_b = opt(p + "o.bias")
            layer.mlp_norm = w(p + "mlp_norm.weight")
            layer.gate_up_w = w(p + "gate_up.weight")
            layer.down_w = w(p + "down.weight")
            self.layers.append(layer)
        self.rope_cos, self.rope_sin = rope_tables(config, self.max_positions, dtype=dtype, device=self.device)
        self.scale = config.head_dim ** -0.5

    def make_kv_cache(self, *, num_pages: int, page_tokens: int) -> PagedKVCache:
        return PagedKVCache(self.config, num_pages=num_pages, page_tokens=page_tokens, dtype=self.dtype,
                            device=self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Returns logits [len(batch.logit_row_ids), vocab] float32."""
        c = self.config
        num_tokens = batch.num_tokens
        nh, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        q_size, kv_size = c.q_size, c.kv_size
        eps = c.rms_norm_eps
        cos = self.rope_cos.index_select(0, batch.positions)[:, None, :]  # [T, 1, d]
        sin = self.rope_sin.index_select(0, batch.positions)[:, None, :]
        h = self.embed.index_select(0, batch.input_ids)  # [T, H]
        for index, layer in enumerate(self.layers):
            x = rms_norm(h, layer.attn_norm, eps)
            qkv = F.linear(x, layer.qkv_w, layer.qkv_b)  # [T, q_size + 2 * kv_size]
            q = qkv[:, :q_size].view(num_tokens, nh, d)
            k = qkv[:, q_size:q_size + kv_size].view(num_tokens, nkv, d)
            v = qkv[:, q_size + kv_size:]
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm, eps)
                k = rms_norm(k, layer.k_norm, eps)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            kv.write(index, batch.write_slot_ids, k.reshape(num_tokens, kv_size), v)
            attn = self._attention(index, batch, kv, q)  # [T, nh * d]
            h = h + F.linear(attn, layer.o_w, layer.o_b)
            x = rms_norm(h, layer.mlp_norm, eps)
            gate_up = F.linear(x, layer.gate_up_w)
            gate, up = gate_up.chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down_w)
        last = h.index_select(0, batch.logit_row_ids)
        last = rms_norm(last, self.final_norm, eps)
        return F.linear(last, self.lm_head).float()

    def _attention(self, layer: int, batch: ForwardBatch, kv: PagedKVCache, q: torch.Tensor) -> torch.Tensor:
        c = self.config
        nh, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        group = nh // nkv
        out = q.new_empty(batch.num_tokens, nh * d)
        if batch.decode_row_ids is not None:
            num_decode = batch.decode_row_ids.shape[0]
            max_context = batch.decode_max_context
            keys, values = kv.gather(layer, batch.decode_gather_slot_ids)
            keys = keys.view(num_decode, max_context, nkv, d).transpose(1, 2)  # [B, nkv, L, d]
            values = values.view(num_decode, max_context, nkv, d).transpose(1, 2)
            # Grouped heads share one kv head: fold the group into the query-length axis instead of
            # repeating K/V (saves the copy).
            qd = q.index_select(0, batch.decode_row_ids).view(num_decode, nkv, group, d)
            scores = torch.matmul(qd, keys.transpose(-1, -2)).float() * self.scale  # [B, nkv, group, L]
            scores = scores.masked_fill(~batch.decode_attn_mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            o = torch.matmul(probs, values)  # [B, nkv, group, d]
            out.index_copy_(0, batch.decode_row_ids, o.reshape(num_decode, nh * d))
        for g in batch.prefill_groups:
            q_len = g.row_end - g.row_start
            context_len = g.gather_slot_ids.shape[0]
            keys, values = kv.gather(layer, g.gather_slot_ids)
            qg = q[g.row_start:g.row_end].transpose(0, 1).unsqueeze(0)  # [1, nh, q_len, d]
            keys = keys.view(context_len, nkv, d).transpose(0, 1).unsqueeze(0)  # [1, nkv, L, d]
            values = values.view(context_len, nkv, d).transpose(0, 1).unsqueeze(0)
            if g.attn_mask is None:
                o = F.scaled_dot_product_attention(qg, keys, values, is_causal=True, scale=self.scale,
                                                   enable_gqa=group > 1)
            else:
                o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=g.attn_mask, scale=self.scale,
                                                   enable_gqa=group > 1)
            out[g.row_start:g.row_end] = o[0].transpose(0, 1).reshape(q_len, nh * d)
        return out
