"""A model's own torch layers as the CUDA graphs capture them, for families outside the Llama layer the fused
kernels run (ModelConfig.graph_obstacle: Gemma 3, mixtures of experts, partial rotary, post-norms, ...).

``generic_layers`` runs DecoderModel._layer_stack over static token rows with each attention handed to a paged
kernel (the decoder's Triton decode or prefill attention, at the layer's own window) instead of the eager
forward's gathers, and each layer's new keys and values written into the decoder's pools by the layer's kv index:
every op a fixed shape, no host sync, so one capture serves every step of that shape.
ModelConfig.torch_graphs_obstacle names what this cannot run (recurrent state, sinks, soft caps, ...).
"""

from __future__ import annotations

import torch

from flared.model.batch import ForwardBatch
from flared.model.kv_cache import to_storage


def write_kv(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """pool [slots, nkv, d] (one layer's K or V) at ``slots`` <- x [T, nkv, d] in the activation dtype; into a
    float8 pool saturated at +-448, as the Triton kernels store (kv_cache.to_storage)."""
    if pool.dtype == x.dtype:
        pool.index_copy_(0, slots, x)
        return
    pool.view(torch.uint8).index_copy_(0, slots, to_storage(x, pool.dtype).view(torch.uint8))


class PoolWriter:
    """The KV side of DecoderModel._layer_stack for the graphs: a layer's new keys and values into the pools
    [kv layers, slots, nkv, d] at their slots; no recurrent state."""

    states = None

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor):
        self.k_pool, self.v_pool = k_pool, v_pool
        self.storage_dtype = k_pool.dtype

    def write(self, kv_index: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        write_kv(self.k_pool[kv_index], slots, k)
        write_kv(self.v_pool[kv_index], slots, v)


def attention_sinks(model) -> list[torch.Tensor | None]:
    """Each layer's sinks (gpt-oss': a logit per query head) as float32 [nh], as the paged kernels read them; None
    for a layer without."""
    return [None if layer.sinks is None else layer.sinks.float().contiguous() for layer in model.layers]


def generic_layers(model, k_pool: torch.Tensor, v_pool: torch.Tensor, tokens: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor, attend, sinks: list) -> torch.Tensor:
    """Every layer of ``model`` (a DecoderModel) over the rows ``tokens`` at ``positions``, their keys and values
    written at ``slots``; each attention as ``attend(q [T, nh, d], kv_index, out [T, nh, d], window=w, sinks=s,
    softcap=cap)`` (the paged kernels' form, ``w`` the layer's window, 0 = none; ``s`` its entry of ``sinks``
    (attention_sinks(model)); ``cap`` Gemma 2's cap on the scaled scores, 0 = none).
    Returns the final-normed hidden states [T, H]."""
    c = model.config
    num_tokens = tokens.shape[0]
    softcap = c.attn_logit_softcapping or 0.0
    batch = ForwardBatch(input_ids=tokens, positions=positions, write_slot_ids=slots, logit_row_ids=None,
                         decode_row_ids=None, decode_gather_slot_ids=None, decode_attn_mask=None,
                         decode_max_context=0, num_tokens=num_tokens)

    def attend_layer(q: torch.Tensor, index: int, kv_index: int) -> torch.Tensor:
        out = torch.empty(num_tokens, c.num_heads, c.head_dim, dtype=q.dtype, device=q.device)
        attend(q, kv_index, out, window=c.window_of(index), sinks=sinks[index], softcap=softcap)
        return out.view(num_tokens, c.num_heads * c.head_dim)

    h = model._layer_stack(batch, PoolWriter(k_pool, v_pool), attend=attend_layer)
    return model._norm(h, model.final_norm)
