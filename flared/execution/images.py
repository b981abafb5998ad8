"""A step's image rows and 3D rope positions, from its participants' requests' images.

A request with images carries a ``VisionInput`` (flared.runtime.request) on its sampler state (``vision``): the
prompt indices of its image tokens, the tower's rows for them, and for Qwen VL the prompt's (temporal, row,
column) positions. Both executors place a step's images through ``place_images``:

- the eager one into its ``ForwardBatch`` (flared.model.batch's ``ImageRows.apply``);
- the CUDA graph one into an eager prefill of its decoder over the static inputs (the graphs themselves take
  token ids only), and, for steps without image tokens, by writing the rows' rope positions (``flat_positions``):
  every text token's three positions are equal, which is plain rope at that position.

Rules:
- Participant i owns the step's rows ``bounds[i]..bounds[i] + counts[i]``, at prompt indices from ``starts[i]``.
- A row past a request's prompt sits at its index plus the prompt's delta on all three axes.
"""

from __future__ import annotations

import numpy as np
import torch

from flared.model.batch import ImageRows


def rope_positions(states, starts, counts, bounds, positions) -> np.ndarray | None:
    """[3, T] int64: each row's (temporal, row, column) rope position, where some participant's request has 3D
    positions (Qwen VL with images); rows of the others keep ``positions`` (their own, T of them) on all three.
    None where no participant has them."""
    out = None
    for i, state in enumerate(states):
        vision = getattr(state, "vision", None)
        if vision is None or vision.mrope is None:
            continue
        if out is None:
            out = np.repeat(np.asarray(positions, dtype=np.int64)[None], 3, axis=0)
        index = np.arange(int(starts[i]), int(starts[i]) + int(counts[i]), dtype=np.int64)
        inside = index < vision.mrope.shape[1]
        own = np.repeat((index + vision.mrope_delta)[None], 3, axis=0)
        own[:, inside] = vision.mrope[:, index[inside]]
        out[:, int(bounds[i]):int(bounds[i]) + len(index)] = own
    return out


def image_rows(states, starts, counts, bounds) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    """The step's rows that are image tokens of their requests' (one array a participant that has any) and the
    tower's rows for them; empty lists where the step feeds no image token."""
    rows, values = [], []
    for i, state in enumerate(states):
        vision = getattr(state, "vision", None)
        if vision is None or vision.features is None:
            continue
        start = int(starts[i])
        lo, hi = np.searchsorted(vision.positions, [start, start + int(counts[i])])
        if hi > lo:
            rows.append(vision.positions[lo:hi] - start + int(bounds[i]))
            values.append(vision.features[lo:hi])
    return rows, values


def shifted_positions(states, starts) -> np.ndarray:
    """Decode rows (one a participant, at prompt index ``starts[i]``): each row's plain-rope position. A request
    with 3D positions turns a row past its prompt at its index plus the prompt's delta (a decode row is never an
    image token); the others at their index."""
    out = np.array(starts, dtype=np.int64)
    for i, state in enumerate(states):
        vision = getattr(state, "vision", None)
        if vision is None or vision.mrope is None:
            continue
        index = int(out[i])
        out[i] = vision.mrope[0, index] if index < vision.mrope.shape[1] else index + vision.mrope_delta
    return out


def place_images(states, starts, counts, bounds, positions, *, hidden: int, device) -> ImageRows | None:
    """The step's image rows (those of its participants' image tokens it feeds) and, where a request has them,
    every row's 3D rope positions; None where the step has neither."""
    rows, values = image_rows(states, starts, counts, bounds)
    return join_images(rows, values, rope_positions(states, starts, counts, bounds, positions), hidden=hidden,
                       device=device)


def join_images(rows, values, mrope, *, hidden: int, device) -> ImageRows | None:
    """``image_rows``' rows and values and ``rope_positions``' table as one ImageRows on ``device`` (the tower's
    DeepStack columns, past ``hidden``, apart); None where there are neither rows nor a table."""
    if not rows and mrope is None:
        return None
    mrope_t = None if mrope is None else torch.as_tensor(mrope, dtype=torch.int64, device=device)
    if not rows:
        return ImageRows(torch.zeros(0, dtype=torch.int64, device=device), None, None, mrope_t)
    index = torch.as_tensor(np.concatenate(rows), dtype=torch.int64, device=device)
    joined = torch.cat(values).to(device) if len(values) > 1 else values[0].to(device)
    deepstack = None
    if joined.shape[1] > hidden:  # the tower's DeepStack rows follow the embedding's
        deepstack = list(joined[:, hidden:].split(hidden, dim=1))
    return ImageRows(index, joined[:, :hidden], deepstack, mrope_t)


def flat_positions(mrope: np.ndarray) -> np.ndarray | None:
    """Rows whose three rope positions are equal turn as plain rope does at that position: their positions, or None
    where some row's differ (an image token's, which needs the 3D tables)."""
    if (mrope == mrope[0]).all():
        return mrope[0]
    return None


def atomic_spans(model, vision) -> tuple[tuple[int, int], ...]:
    """The prompt spans (start, end) one prefill chunk must feed whole (RequestScheduler.admit's atomic_spans):
    each image's tokens where they attend to each other both ways (Gemma 3: DecoderModel.set_image_blocks), else
    none. ``vision``: the request's VisionInput or None."""
    if vision is None or not getattr(model, "image_block_tokens", ()):
        return ()
    positions = np.asarray(vision.positions)
    if not len(positions):
        return ()
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1  # (an image's tokens are contiguous)
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(positions)]))
    return tuple((int(positions[a]), int(positions[b - 1]) + 1) for a, b in zip(starts, ends))
