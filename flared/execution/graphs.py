"""Graph inputs layout, its validation, and the captured CUDA graphs of one core.

``ExecutionManifest`` names every static input as a byte span of one device
buffer (and of each pinned input frame, which has the same layout), and the
graph capacities to capture. ``validate()`` checks it completely before
anything is allocated: capacities positive and ordered, unique names, spans
aligned, in bounds, non-overlapping, and each span's bytes equal to its
shape times its dtype's size.

``GraphSet`` allocates the device input buffer, hands its views to the
decoder as ``StaticInputs``, warms every shape eagerly (Triton compiles,
cuBLAS picks kernels), then captures: prefill graphs for each token
capacity and decode graphs for each batch capacity (greedy and full
sampling), largest first, all in one graph memory pool, on the model stream.
``launch(key, stream)`` replays through CuPy's ``cudaGraphLaunch``.

Rules:
- The span order is fixed by ``INPUT_FIELDS``; the executor uploads only
  the byte ranges a step changed and the rest keeps its device value.
- Capture happens once at load; a capture failure is an ExecutionError and
  the core does not become ready.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flared.errors import ErrorKind, ExecutionError

SPAN_ALIGN_BYTES = 256

# (name, dtype, shape in terms of T = max tokens, B = max batch, P = max pages per sequence)
INPUT_FIELDS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("token_ids", "int64", ("T",)),
    ("positions", "int64", ("T",)),
    ("slot_ids", "int64", ("T",)),
    ("state_rows", "int64", ("B",)),
    ("block_tables", "int32", ("B", "P")),
    ("context_lens", "int32", ("B",)),
    ("chunk_meta", "int32", ("2",)),
    ("logit_row", "int64", ("1",)),
    ("temperature", "float32", ("B",)),
    ("top_k", "int32", ("B",)),
    ("top_p", "float32", ("B",)),
    ("seeds", "int64", ("B",)),
    ("steps", "int64", ("B",)),
)


@dataclass(frozen=True)
class Span:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int
    nbytes: int


@dataclass(frozen=True)
class ExecutionManifest:
    decode_batch_sizes: tuple[int, ...]
    prefill_token_sizes: tuple[int, ...]
    max_pages_per_sequence: int
    spans: tuple[Span, ...]
    total_bytes: int

    @classmethod
    def build(cls, *, decode_batch_sizes, prefill_token_sizes, max_pages_per_sequence: int) -> ExecutionManifest:
        decode_batch_sizes = tuple(sorted(int(b) for b in decode_batch_sizes))
        prefill_token_sizes = tuple(sorted(int(t) for t in prefill_token_sizes))
        max_batch = max(decode_batch_sizes) if decode_batch_sizes else 1
        max_tokens = max(max(prefill_token_sizes, default=1), max_batch)
        dims = {"T": max_tokens, "B": max_batch, "P": max_pages_per_sequence, "1": 1, "2": 2}
        spans = []
        offset = 0
        for name, dtype, shape_names in INPUT_FIELDS:
            shape = tuple(dims[s] for s in shape_names)
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            spans.append(Span(name, dtype, shape, offset, nbytes))
            offset += -(-nbytes // SPAN_ALIGN_BYTES) * SPAN_ALIGN_BYTES
        return cls(decode_batch_sizes, prefill_token_sizes, max_pages_per_sequence, tuple(spans), offset)

    @property
    def max_batch(self) -> int:
        return max(self.decode_batch_sizes)

    @property
    def max_tokens(self) -> int:
        return max(max(self.prefill_token_sizes, default=1), self.max_batch)

    def span(self, name: str) -> Span:
        for s in self.spans:
            if s.name == name:
                return s
        raise KeyError(name)

    def validate(self) -> None:
        def bad(what: str) -> ExecutionError:
            return ExecutionError(f"execution manifest: {what}", ErrorKind.EXECUTION)

        if not self.decode_batch_sizes or any(b <= 0 for b in self.decode_batch_sizes):
            raise bad(f"decode batch sizes must be positive, got {self.decode_batch_sizes}")
        if any(t <= 0 for t in self.prefill_token_sizes):
            raise bad(f"prefill token sizes must be positive, got {self.prefill_token_sizes}")
        for sizes, what in ((self.decode_batch_sizes, "decode batch"), (self.prefill_token_sizes, "prefill token")):
            if len(set(sizes)) != len(sizes):
                raise bad(f"{what} sizes repeat: {sizes}")
        if self.max_pages_per_sequence <= 0:
            raise bad(f"max_pages_per_sequence must be positive, got {self.max_pages_per_sequence}")
        names = [s.name for s in self.spans]
        if len(set(names)) != len(names):
            raise bad(f"span names repeat: {names}")
        if set(names) != {f[0] for f in INPUT_FIELDS}:
            raise bad(f"spans {sorted(names)} are not the graph inputs {sorted(f[0] for f in INPUT_FIELDS)}")
        end = 0
        for s in sorted(self.spans, key=lambda s: s.offset_bytes):
            if s.offset_bytes % SPAN_ALIGN_BYTES:
                raise bad(f"span {s.name} at byte {s.offset_bytes} is not {SPAN_ALIGN_BYTES}-byte aligned")
            if s.offset_bytes < end:
                raise bad(f"span {s.name} at byte {s.offset_bytes} overlaps the span before it (ends at {end})")
            expected = int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
            if s.nbytes != expected:
                raise bad(f"span {s.name} holds {s.nbytes} bytes, its shape {s.shape} of {s.dtype} needs {expected}")
            end = s.offset_bytes + s.nbytes
        if end > self.total_bytes:
            raise bad(f"spans end at byte {end}, past the buffer's {self.total_bytes}")

    def host_views(self, buffer: np.ndarray) -> dict[str, np.ndarray]:
        """Typed numpy views of a uint8 buffer (a pinned frame) laid out like the device inputs."""
        if buffer.nbytes < self.total_bytes:
            raise ExecutionError(f"frame of {buffer.nbytes} bytes is smaller than the {self.total_bytes}-byte layout")
        return {s.name: buffer[s.offset_bytes:s.offset_bytes + s.nbytes].view(s.dtype).reshape(s.shape)
                for s in self.spans}


def time_graph_us(fn, stream, *, calls_per_graph: int = 1, replays: int = 20) -> float:
    """GPU microseconds per call of ``fn`` as a CUDA graph pays them (launch gaps included): ``fn`` runs
    once eagerly (Triton compiles and autotunes there, never inside a capture), is captured
    ``calls_per_graph`` times into one graph on ``stream`` (a torch.cuda.Stream), and the graph is
    replayed ``replays`` times between two events."""
    import torch

    with torch.cuda.stream(stream):
        fn()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls_per_graph):
                fn()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(replays):
            graph.replay()
        end.record(stream)
        end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls_per_graph)


def graph_key(kind: str, capacity: int, full_sampling: bool = True) -> tuple[str, int, bool]:
    return (kind, capacity, full_sampling)


class GraphSet:
    """Device inputs, the paged decoder and its captured graphs (CUDA only)."""

    def __init__(self, model, manifest: ExecutionManifest, *, num_pages: int, page_tokens: int,
                 num_state_rows: int):
        import torch

        from flared.model.kernels.paged_decoder import PagedCudaDecoder, StaticInputs

        manifest.validate()
        self.manifest = manifest
        self.device = model.device
        self.input_buffer = torch.zeros(manifest.total_bytes, dtype=torch.uint8, device=self.device)
        views = {}
        for s in manifest.spans:
            raw = self.input_buffer[s.offset_bytes:s.offset_bytes + s.nbytes]
            views[s.name] = raw.view(getattr(torch, s.dtype)).view(s.shape)
        self.inputs = StaticInputs(**views)
        self.decoder = PagedCudaDecoder(model, self.inputs, num_pages=num_pages, page_tokens=page_tokens,
                                        num_state_rows=num_state_rows, max_batch=manifest.max_batch,
                                        max_tokens=manifest.max_tokens)
        self.graphs: dict[tuple[str, int, bool], torch.cuda.CUDAGraph] = {}
        self.graph_execs: dict[tuple[str, int, bool], int] = {}
        self.capture_s = 0.0

    @property
    def input_ptr(self) -> int:
        return self.input_buffer.data_ptr()

    def _reset_inputs(self) -> None:
        """Inputs that make every shape valid to run: padding rows, scratch slots, an empty chunk."""
        s = self.inputs
        s.token_ids.zero_()
        s.positions.zero_()
        s.slot_ids.fill_(self.decoder.scratch_slot)
        s.state_rows.zero_()
        s.block_tables.fill_(self.decoder.num_pages)  # the scratch page
        s.context_lens.zero_()
        s.chunk_meta.zero_()
        s.logit_row.zero_()
        s.temperature.zero_()
        s.top_k.zero_()
        s.top_p.fill_(1.0)
        s.seeds.zero_()
        s.steps.zero_()

    def _run_eager(self, key) -> None:
        kind, capacity, full = key
        if kind == "decode":
            self.decoder.decode(capacity, full)
        else:
            self.decoder.prefill(capacity)

    def keys(self) -> list[tuple[str, int, bool]]:
        m = self.manifest
        keys = [graph_key("prefill", t) for t in m.prefill_token_sizes]
        for b in m.decode_batch_sizes:
            keys += [graph_key("decode", b, False), graph_key("decode", b, True)]
        # Largest first: later, smaller graphs reuse the pool's blocks.
        return sorted(keys, key=lambda k: (-k[1], k[0], k[2]))

    def capture(self, stream) -> None:
        """Warm every shape, then capture all graphs on ``stream`` (a torch.cuda.Stream) in one pool."""
        import time

        import torch

        started = time.perf_counter()
        keys = self.keys()
        try:
            with torch.inference_mode(), torch.cuda.stream(stream):
                self._reset_inputs()
                self.decoder.calibrate(stream)
                self._reset_inputs()
                for key in keys:
                    self._run_eager(key)
                stream.synchronize()
                pool = torch.cuda.graph_pool_handle()
                for key in keys:
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool, stream=stream):
                        self._run_eager(key)
                    self.graphs[key] = g
                    self.graph_execs[key] = int(g.raw_cuda_graph_exec())
                stream.synchronize()
        except ExecutionError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch/Triton raise many types; the core must not become ready
            raise ExecutionError(f"CUDA graph capture failed: {type(exc).__name__}: {exc}", ErrorKind.DEVICE) from exc
        self.capture_s = time.perf_counter() - started

    def pick(self, kind: str, size: int, full_sampling: bool = True) -> tuple[str, int, bool]:
        """Smallest captured capacity that holds ``size``."""
        sizes = self.manifest.decode_batch_sizes if kind == "decode" else self.manifest.prefill_token_sizes
        for cap in sizes:
            if cap >= size:
                return graph_key(kind, cap, full_sampling if kind == "decode" else True)
        raise ExecutionError(f"no {kind} graph holds {size} (captured: {sizes})", ErrorKind.MODEL_CAPACITY)
