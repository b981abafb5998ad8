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

Slots, for adapters loaded while serving (``slots``): the graphs are captured once, so the stack is laid out for
them up front. Every product of every layer holds ``slots`` column ranges of one width (``slot_width``), zeros
until an adapter is written into one (``install``, on the stream the graphs run on, between steps). The column
ranges' owners (``column_adapter``) live on the device, so a graph picks up a new adapter's index with no
recapture; a released slot's columns belong to no index (-1) and are masked out of every row.
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


def stacked_width(factors: dict | None) -> int:
    """The columns an adapter owns in the stack: its widest product's parts' ranks added up (qkv's q, k and v)."""
    width = 0
    for name, parts in (factors or {}).items():
        _key(name)
        width = max(width, sum(A.shape[0] for _, _, A, _ in parts))
    return width


def _write(a_cat: torch.Tensor, b_cat: torch.Tensor, column: int, parts) -> None:
    """One adapter's parts of a product into float32 ``a_cat`` [K, R] / ``b_cat`` [R, N] from ``column`` on."""
    for row, count, A, B in parts:
        r = A.shape[0]
        a_cat[:, column:column + r] = A.t()
        b_cat[column:column + r, row:row + count] = B.t()
        column += r


class StackedLora:
    """Every per-request adapter of a decoder, stacked per layer and product (module docstring).

    ``adapters[k]`` is adapter k + 1 (a request's ``lora`` index): ``lora.lora_factors``' factors (serving tensor
    name -> [(first row, row count, A [r, K], B [count, r] already scaled)], float32), or None for an index that
    holds no adapter (it gets no columns: its rows run the base weights).

    ``slots``: lay the stack out for adapters loaded later (module docstring): ``slots`` ranges of ``slot_width``
    columns in every product of every layer, adapter k + 1 in slot k; ``install`` and ``release`` change them."""

    def __init__(self, config, adapters, *, dtype: torch.dtype, device: torch.device | str,
                 slots: int | None = None, slot_width: int | None = None):
        adapters = list(adapters)
        self.num_adapters = len(adapters)
        self.dtype = dtype
        widths = [stacked_width(factors) for factors in adapters]
        self.slots = slots
        if slots is None:
            owners = list(range(1, self.num_adapters + 1))
        else:
            slot_width = max([slot_width or 0] + widths)
            if slots < self.num_adapters or slot_width <= 0:
                raise ValueError(f"{slots} LoRA slots of {slot_width} columns cannot hold {self.num_adapters} adapters")
            widths = [slot_width] * slots
            owners = [k + 1 if k < self.num_adapters and adapters[k] is not None else -1 for k in range(slots)]
        self.slot_width = slot_width
        self.offsets = [0]  # range k's first column (adapter k + 1's without slots)
        for width in widths:
            self.offsets.append(self.offsets[-1] + width)
        self.rank = self.offsets[-1]  # R: the stacked columns of all adapters
        # column j belongs to adapter column_adapter[j] (>= 1; -1: none); compared with each row's id in masks()
        self.column_adapter = torch.repeat_interleave(torch.tensor(owners, dtype=torch.int32),
                                                      torch.tensor(widths, dtype=torch.int64)).to(device)
        self.slot_adapter = owners  # on the host: each range's adapter index (-1: free)
        self.factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        shapes = serving_tensor_shapes(config)  # name -> (out features N, in features K)
        stacked: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

        def room(layer: int, product: str) -> tuple[torch.Tensor, torch.Tensor]:
            """The product's float32 A_cat [K, R] and B_cat [R, N], zeros when new."""
            if (layer, product) not in stacked:
                out_features, in_features = shapes[f"layers.{layer}.{product}.weight"]
                stacked[(layer, product)] = (torch.zeros(in_features, self.rank), torch.zeros(self.rank, out_features))
            return stacked[(layer, product)]

        if slots is not None:  # every product of every layer, for whatever an adapter loaded later targets
            for layer in range(config.num_layers):
                for product in PRODUCTS:
                    room(layer, product)
        for k, factors in enumerate(adapters):
            for name, parts in (factors or {}).items():
                _write(*room(*_key(name)), self.offsets[k], parts)
        for key, (a_cat, b_cat) in stacked.items():
            self.factors[key] = (a_cat.to(device=device, dtype=dtype).contiguous(),
                                 b_cat.to(device=device, dtype=dtype).contiguous())

    def free_slot(self) -> int | None:
        """A slot that holds no adapter, or None (all taken; or a stack without slots)."""
        if self.slots is None:
            return None
        return next((k for k, owner in enumerate(self.slot_adapter) if owner == -1), None)

    def slot_of(self, index: int) -> int | None:
        """The slot adapter ``index`` is in, or None."""
        if self.slots is None or index not in self.slot_adapter:
            return None
        return self.slot_adapter.index(index)

    def install(self, slot: int, factors: dict, index: int) -> None:
        """Write adapter ``index``'s factors into ``slot`` (free) of every product, then give it the slot's columns.
        Runs on the current stream: the model stream, between steps, so no graph reads a half-written slot."""
        if self.slots is None or not 0 <= slot < self.slots:
            raise ValueError(f"no LoRA slot {slot} (slots: {self.slots})")
        if self.slot_adapter[slot] != -1:
            raise ValueError(f"LoRA slot {slot} holds adapter {self.slot_adapter[slot]}")
        width = stacked_width(factors)  # (it checks every name too)
        if width > self.slot_width:
            raise ValueError(f"the adapter needs {width} stacked columns; a slot has {self.slot_width}")
        column = self.offsets[slot]
        for (layer, product), (a_cat, b_cat) in self.factors.items():
            a_block = torch.zeros(a_cat.shape[0], self.slot_width)
            b_block = torch.zeros(self.slot_width, b_cat.shape[1])
            _write(a_block, b_block, 0, factors.get(f"layers.{layer}.{product}.weight", ()))
            a_cat[:, column:column + self.slot_width].copy_(a_block.to(dtype=self.dtype), non_blocking=False)
            b_cat[column:column + self.slot_width].copy_(b_block.to(dtype=self.dtype), non_blocking=False)
        self.column_adapter[column:column + self.slot_width].fill_(index)
        self.slot_adapter[slot] = index

    def release(self, slot: int) -> None:
        """``slot``'s columns belong to no adapter from the next step on (its factors stay, masked out)."""
        column = self.offsets[slot]
        self.column_adapter[column:column + self.slot_width].fill_(-1)
        self.slot_adapter[slot] = -1

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
