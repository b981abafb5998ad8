"""A model's own torch layers as the CUDA graphs capture them, for families outside the Llama layer the fused
kernels run (ModelConfig.kernels_obstacle: Gemma 3, mixtures of experts, partial rotary, post-norms, latent attention,
head dims that are not powers of two, ...).

``generic_layers`` runs DecoderModel._layer_stack over static token rows with each attention handed to a paged
kernel (the decoder's Triton decode or prefill attention, at the layer's own window) instead of the eager
forward's gathers, and each layer's new keys and values written into the decoder's pools by the layer's kv index:
every op a fixed shape, no host sync, so one capture serves every step of that shape.
ModelConfig.torch_graphs_obstacle names what this cannot run (recurrent state, Gemma 4's global heads, ...).
"""

from __future__ import annotations

import torch

from flared.model.batch import ForwardBatch
from flared.model.kv_cache import to_storage


def generic_reason(config, quantization) -> str | None:
    """Why the CUDA graphs run a model's own torch layers instead of the fused Llama kernels, None where they do not:
    its family (ModelConfig.kernels_obstacle), or layer matrices kept quantised (``quantization``: a format's name
    or a QuantPlan; kernels/wquant.py's products), which the fused kernels' bf16 loads cannot take."""
    if config.kernels_obstacle is not None:
        return config.kernels_obstacle
    if quantization is None:
        return None
    return f"{getattr(quantization, 'default', quantization)} weights"


def write_kv(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """pool [slots, nkv, d] (one layer's K or V) at ``slots`` <- x [T, nkv, d] in the activation dtype; into a
    float8 pool saturated at +-448, as the Triton kernels store (kv_cache.to_storage)."""
    if pool.dtype == x.dtype:
        pool.index_copy_(0, slots, x)
        return
    pool.view(torch.uint8).index_copy_(0, slots, to_storage(x, pool.dtype).view(torch.uint8))


def layer_pool(pool: torch.Tensor, geometry: tuple[int, int]) -> torch.Tensor:
    """One layer's pool [slots, storage rows, d] as that layer's own heads [slots, heads, dim], a view: the first
    heads * dim / d rows of each slot, each head its consecutive d-wide pieces (Gemma 4's global layers keep their
    wider heads so, ModelConfig.kv_storage_heads; its windowed layers, the first rows where a slot holds more)."""
    heads, dim = geometry
    if pool.shape[1:] == (heads, dim):
        return pool
    return pool.flatten(1)[:, :heads * dim].unflatten(1, (heads, dim))


class PoolWriter:
    """The KV side of DecoderModel._layer_stack for the graphs: a layer's new keys and values into the pools
    [kv layers, slots, storage rows, d] at their slots (layer_pool: a layer's own heads); no recurrent state."""

    states = None

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor):
        self.k_pool, self.v_pool = k_pool, v_pool
        self.storage_dtype = k_pool.dtype

    def write(self, kv_index: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """v None: the cache keeps no values (ModelConfig.latent_kv: the keys' latent part serves as them)."""
        geometry = tuple(k.shape[1:])
        write_kv(layer_pool(self.k_pool[kv_index], geometry), slots, k)
        if v is not None:
            write_kv(layer_pool(self.v_pool[kv_index], geometry), slots, v)


def attention_sinks(model) -> list[torch.Tensor | None]:
    """Each layer's sinks (gpt-oss': a logit per query head) as float32 [nh], as the paged kernels read them; None
    for a layer without."""
    return [None if layer.sinks is None else layer.sinks.float().contiguous() for layer in model.layers]


def generic_layers(model, k_pool: torch.Tensor, v_pool: torch.Tensor, tokens: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor, attend, sinks: list, images=None) -> torch.Tensor:
    """Every layer of ``model`` (a DecoderModel) over the rows ``tokens`` at ``positions``, their keys and values
    written at ``slots``; each attention as ``attend(q [T, nh, d], kv_index, out [T, nh, d], window=w, sinks=s,
    softcap=cap, geometry=g, alibi=a)`` (the paged kernels' form, ``w`` the layer's window, 0 = none; ``s`` its entry
    of ``sinks`` (attention_sinks(model)); ``cap`` Gemma 2's cap on the scaled scores, 0 = none; ``g`` (kv heads, d)
    of the layer, Gemma 4's global layers' their own: layer_pool's view of the pools; ``a`` BLOOM's ALiBi slopes
    [nh], None = none). Latent attention served absorbed (ModelConfig.latent_kv) attends as ``attend(q [T, nh,
    latent + rope], kv_index, out [T, nh, latent], latent=latent)``.
    ``images``: a prefill's image rows and 3D rope positions (flared.model.batch.ImageRows), placed by the model's own
    forward; None: none. Returns the final-normed hidden states [T, H]."""
    c = model.config
    num_tokens = tokens.shape[0]
    softcap = c.attn_logit_softcapping or 0.0
    batch = ForwardBatch(input_ids=tokens, positions=positions, write_slot_ids=slots, logit_row_ids=None,
                         decode_row_ids=None, decode_gather_slot_ids=None, decode_attn_mask=None,
                         decode_max_context=0, num_tokens=num_tokens)
    if images is not None:
        images.apply(batch)

    def attend_layer(q: torch.Tensor, index: int, kv_index: int) -> torch.Tensor:
        if c.latent_kv:  # the absorbed queries [T, nh, latent + rope] over the latent rows -> [T, nh, latent]
            out = q.new_empty(num_tokens, q.shape[1], c.kv_lora_rank)
            attend(q, kv_index, out, latent=c.kv_lora_rank)
            return out.view(num_tokens, -1)
        geometry = model.layers[index].geometry
        out = torch.empty_like(q)
        attend(q, kv_index, out, window=c.window_of(index), sinks=sinks[index], softcap=softcap, geometry=geometry,
               alibi=model.alibi)
        return out.view(num_tokens, -1)

    h = model._layer_stack(batch, PoolWriter(k_pool, v_pool), attend=attend_layer)
    return model._norm(h, model.final_norm)


class ImageBlocks:
    """Gemma 3's images in an eager run of the graphs' prefill forward (PagedCudaDecoder.prefill with image rows):
    each image's tokens also attend forward within the image, as transformers' token_type_ids mask has it (a full
    layer: causal or the image's block; a windowed one: that, and the key inside the window). The paged prefill
    kernel is causal, so ``wrap(attend)`` runs it and then attends the image rows again here, over their keys
    in the pool; the scheduler keeps each image inside one prefill chunk (RequestScheduler.admit's atomic_spans),
    so the pool holds every key of the chunk's images when the layer attends.

    ``tokens`` [T]: the chunk's token ids (sequence s's rows after those of sequences 0..s-1); ``chunk_meta`` [B, 2]
    (num_cached_tokens, num_new_tokens); ``block_tables`` [B, pages]: the paged kernels' inputs. Made once a step
    (a host sync: an eager step only)."""

    def __init__(self, tokens: torch.Tensor, chunk_meta: torch.Tensor, block_tables: torch.Tensor, token_ids,
                 page_tokens: int, windowed_only: bool = False):
        ids = tokens.cpu()
        marks = torch.tensor(tuple(token_ids), dtype=ids.dtype)
        self.windowed_only = windowed_only  # (Gemma 4: the global layers stay causal)
        self.runs = []  # (sequence, first row, end row, first position, end position) an image
        row = 0
        for s, (cached, new) in enumerate(chunk_meta.cpu().tolist()):
            image = torch.isin(ids[row:row + new], marks).tolist()
            i = 0
            while i < new:
                if not image[i]:
                    i += 1
                    continue
                j = i
                while j < new and image[j]:
                    j += 1
                self.runs.append((s, row + i, row + j, cached + i, cached + j))
                i = j
            row += new
        self.tables = block_tables
        self.page_tokens = page_tokens
        self._keys: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _run_keys(self, run: int, window: int):
        """Image ``run``'s key slots [L], and its rows' allowed keys [n, L], at ``window`` (0: none)."""
        got = self._keys.get((run, window))
        if got is None:
            s, row0, row1, first, end = self.runs[run]
            device = self.tables.device
            begin = max(0, first - window + 1) if window else 0
            kpos = torch.arange(begin, end, device=device)
            slots = self.tables[s, kpos // self.page_tokens].long() * self.page_tokens + kpos % self.page_tokens
            qpos = torch.arange(first, end, device=device)
            allowed = (kpos[None, :] <= qpos[:, None]) | (kpos[None, :] >= first)  # (causal, or the image)
            if window:
                allowed &= kpos[None, :] > qpos[:, None] - window
            rows = torch.arange(row0, row1, device=device)
            got = self._keys[(run, window)] = (rows, slots, allowed)
        return got

    def attend(self, q: torch.Tensor, out: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, *,
               scale: float, window: int, sinks: torch.Tensor | None, softcap: float) -> None:
        """The image rows of ``out`` [T, nh, d] again: their queries (``q`` [T, nh, d]) over the pool's keys
        [slots, nkv, d], in float32."""
        nh = q.shape[1]
        for run in range(len(self.runs)):
            rows, slots, allowed = self._run_keys(run, window)
            group = nh // k_pool.shape[1]
            k = k_pool.index_select(0, slots).float().repeat_interleave(group, 1)  # [L, nh, d]
            v = v_pool.index_select(0, slots).float().repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q.index_select(0, rows).float(), k) * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~allowed, float("-inf"))
            if sinks is not None:  # (a logit per query head beside each row's keys, taking its share)
                scores = torch.cat((scores, sinks.float().view(nh, 1, 1).expand(nh, scores.shape[1], 1)), -1)
                probs = torch.softmax(scores, -1)[..., :-1]
            else:
                probs = torch.softmax(scores, -1)
            out.index_copy_(0, rows, torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype))

    def wrap(self, attend, pools, default_window: int, scale: float):
        """``attend`` (the paged kernels' form, generic_layers) followed by attend() at the layer's window;
        ``pools(layer, geometry)``: that layer's K and V pools as the kernels read them."""
        if not self.runs:
            return attend

        def attend_with_images(q, layer, out, window=None, sinks=None, softcap=0.0, geometry=None, alibi=None,
                               latent=0):
            if latent or alibi is not None:
                raise ValueError("images that attend both ways need neither latent attention nor ALiBi here")
            attend(q, layer, out, window=window, sinks=sinks, softcap=softcap, geometry=geometry)
            window = default_window if window is None else window
            if self.windowed_only and not window:
                return
            k_pool, v_pool = pools(layer, geometry)
            self.attend(q, out, k_pool, v_pool, scale=scale, window=window, sinks=sinks, softcap=softcap)

        return attend_with_images
