"""Per-request LoRA adapters for the CUDA graph decoder: every adapter's factors stacked, rows picked by a mask.

The CPU forward (``DecoderModel._lora``) groups a step's rows by adapter and runs each group's low-rank
products apart, over row lists that change from step to step: a captured graph cannot take them. Here each
layer's product (qkv, o, gate_up, down) holds every adapter's factors side by side in one pair of matrices,
and a row keeps its own adapter's columns through a 0/1 mask:

    y += ((x @ A_cat) * mask) @ B_cat

- ``A_cat`` [K, R]: adapter k's A^T (its parts' A stacked, as ``DecoderModel.add_lora_module`` stacks them:
  q, k and v of the fused qkv, gate and up of gate_up) in its own column range, its rank block.
- ``B_cat`` [R, N]: the matching rows of each part's B^T (the adapter's scale folded in at load, as
  ``lora.lora_factors`` gives it) at the output columns that part adapts; zeros elsewhere.
- ``mask`` [rows, R]: 1 where a column belongs to the row's adapter (``lora_ids``, 0 = the base weights), made
  on the device from the step's ids (``masks``): no host sync, no shape that depends on the ids.

A base row's term is an exact zero, so its y keeps its bits. Every adapter owns the same column range in every
product, as wide as its widest stacked rank (qkv's three parts, usually), so one mask a step serves every
product; where an adapter is narrower or targets nothing its columns are zeros (memory, and a few columns of
arithmetic, that the single mask costs). A product that no adapter targets at a layer holds no matrices and
``add`` skips it. Everything is in the decoder's dtype, rounded once from the float32 factors. On a GPU in half
precision the mask and the product back up are one Triton launch (``fused.lora_expand``): two launches a product,
not three.
"""

from __future__ import annotations

import torch

from flared.model.loader import serving_tensor_shapes

PRODUCTS = ("qkv", "o", "gate_up", "down")


def _key(name: str) -> tuple[int, str]:
    """(layer, product) of a serving tensor name ``layers.<i>.<product>.weight``."""
    pieces = name.split(".")
    if len(pieces) != 4 or pieces[0] != "layers" or pieces[2] not in PRODUCTS or pieces[3] != "weight":
        raise ValueError(f"a per-request LoRA adapter adapts the layers' products only, not {name}")
    return int(pieces[1]), pieces[2]


class StackedLora:
    """Every per-request adapter of a decoder, stacked per layer and product (module docstring).

    ``adapters[k]`` is adapter k + 1 (a request's ``lora`` index): ``lora.lora_factors``' factors (serving tensor
    name -> [(first row, row count, A [r, K], B [count, r] already scaled)], float32), or None for an index that
    holds no adapter (it gets no columns: its rows run the base weights)."""

    def __init__(self, config, adapters, *, dtype: torch.dtype, device: torch.device | str):
        adapters = list(adapters)
        self.num_adapters = len(adapters)
        widths = []
        for factors in adapters:
            width = 0
            for name, parts in (factors or {}).items():
                _key(name)
                width = max(width, sum(A.shape[0] for _, _, A, _ in parts))
            widths.append(width)
        self.offsets = [0]  # adapter k + 1's first column
        for width in widths:
            self.offsets.append(self.offsets[-1] + width)
        self.rank = self.offsets[-1]  # R: the stacked columns of all adapters
        # column j belongs to adapter column_adapter[j] (>= 1); compared with each row's id in masks()
        self.column_adapter = torch.repeat_interleave(torch.arange(1, self.num_adapters + 1, dtype=torch.int32),
                                                      torch.tensor(widths, dtype=torch.int64)).to(device)
        self.factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        shapes = serving_tensor_shapes(config)  # name -> (out features N, in features K)
        stacked: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for k, factors in enumerate(adapters):
            for name, parts in (factors or {}).items():
                layer, product = _key(name)
                if (layer, product) not in stacked:
                    out_features, in_features = shapes[name]
                    stacked[(layer, product)] = (torch.zeros(in_features, self.rank),
                                                 torch.zeros(self.rank, out_features))
                a_cat, b_cat = stacked[(layer, product)]
                column = self.offsets[k]
                for row, count, A, B in parts:
                    r = A.shape[0]
                    a_cat[:, column:column + r] = A.t()
                    b_cat[column:column + r, row:row + count] = B.t()
                    column += r
        for key, (a_cat, b_cat) in stacked.items():
            self.factors[key] = (a_cat.to(device=device, dtype=dtype).contiguous(),
                                 b_cat.to(device=device, dtype=dtype).contiguous())

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.factors.values())

    def masks(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[rows, R] of 0 and 1 in ``dtype``: row i keeps the columns of adapter ``ids[i]`` (0: none). One compare
        on the device (capturable: its shape is the ids' and the stack's)."""
        return (ids[:, None] == self.column_adapter[None, :]).to(dtype)

    def add(self, layer: int, product: str, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``y`` [rows, N] (``x`` [rows, K] times the layer's ``product`` weight) += each row's adapter term, in
        place, and returned; a product no adapter targets at this layer is left as it is."""
        entry = self.factors.get((layer, product))
        if entry is None:
            return y
        a_cat, b_cat = entry
        low = torch.mm(x, a_cat)  # [rows, R]
        if y.is_cuda and y.dtype != torch.float32:  # the mask and the product back up in one launch
            from flared.model.kernels import fused

            return fused.lora_expand(low, mask, b_cat, y)
        return y.addmm_(low.mul_(mask), b_cat)  # the rows' own adapter columns only
