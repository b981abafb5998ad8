"""Decode products at up to 64 rows on Hopper (products64.cu): out = x @ W^T with every multiprocessor streaming
one tile of weight rows, TMA copies into a software pipeline and wgmma on the tensor cores.

A ``Products64`` is one build (tile rows, stages, accumulators, epilogue) for one product shape; each weight matrix it
multiplies gets a TMA tensor map (``weight_map``), made once at load, and each input buffer one too
(``input_map``). The maps are plain 128-byte descriptors passed by value, so a CUDA graph records them with
the launch.

Needs sm_90a (TMA, wgmma) and CuPy's NVRTC; ``available()`` says whether this device has both.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("products64.cu")
ROWS = 64  # the matrix unit's M: one launch serves up to 64 rows
BK = 64  # columns a pipeline stage (one 128-byte swizzle span of bf16)
SHARED_LIMIT = 225 * 1024  # dynamic shared memory a block may take on sm_90 (227 KB) less its static barriers
THREADS = 160  # one consumer warpgroup and a producer warp

_CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9
_CU_TENSOR_MAP_SWIZZLE_128B = 3
_CU_TENSOR_MAP_L2_PROMOTION_256B = 3
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def available() -> bool:
    """A CUDA device of compute capability 9.0 (Hopper) with CuPy (flared.execution.cuda imports)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    import importlib

    try:
        importlib.import_module("flared.execution.cuda")  # the kernel builds and launches through it
    except ImportError:
        return False
    return True


class TensorMap:
    """A 2-D TMA descriptor over a row-major bf16 matrix [rows, cols], boxes of ``box_rows`` x 64 columns with
    the 128-byte swizzle; ``param`` is the address of its 128 bytes (64-byte aligned) for a kernel launch."""

    _encode = None

    def __init__(self, tensor: torch.Tensor, box_rows: int):
        assert tensor.dtype == torch.bfloat16 and tensor.dim() == 2 and tensor.stride(1) == 1
        assert tensor.data_ptr() % 16 == 0 and (tensor.stride(0) * 2) % 16 == 0 and 1 <= box_rows <= 256
        rows, cols = tensor.shape
        self._raw = ctypes.create_string_buffer(128 + 64)
        self.param = (ctypes.addressof(self._raw) + 63) & ~63
        u64, u32 = ctypes.c_uint64, ctypes.c_uint32
        dims = (u64 * 2)(cols, rows)
        strides = (u64 * 1)(tensor.stride(0) * 2)
        box = (u32 * 2)(BK, box_rows)
        elem = (u32 * 2)(1, 1)
        status = self._encoder()(ctypes.c_void_p(self.param), _CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                                 ctypes.c_void_p(tensor.data_ptr()), dims, strides, box, elem, 0,
                                 _CU_TENSOR_MAP_SWIZZLE_128B, _CU_TENSOR_MAP_L2_PROMOTION_256B, 0)
        if status != 0:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUDA status {status} "
                               f"(matrix {rows}x{cols}, box {box_rows}x{BK})")
        self.tensor = tensor  # the map holds its address: keep the memory alive

    @classmethod
    def _encoder(cls):
        if cls._encode is None:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuTensorMapEncodeTiled
            p64, p32 = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, p64, p64, p32, p32,
                           ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
            fn.restype = ctypes.c_int
            cls._encode = fn
        return cls._encode


def wgmma_source(n: int) -> str:
    """``wgmma_n(d, a, b)``: d[64 x n] += A B for one 16-column step, both operands K-major in shared memory."""
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    binds = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return (
        "__device__ __forceinline__ void wgmma_n(float* d, u64 a, u64 b) {\n"
        f'    asm volatile("{{ .reg .pred p; setp.eq.u32 p, 1, 1;\\n"\n'
        f'                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{outs}}}, %{regs}, %{regs + 1}, '
        f'p, 1, 1, 0, 0; }}"\n'
        f"                 : {binds}\n"
        '                 : "l"(a), "l"(b));\n'
        "}\n")


@dataclass(frozen=True)
class Build:
    """One build of the kernel: ``bn`` weight rows a tile, ``stages`` pipeline stages of ``atoms`` 64-column
    boxes, ``nacc`` accumulators taking turns, ``epi`` 1 for the SwiGLU epilogue and 2 for the residual one (out
    is h; h += the product, h * the next norm's weight to another buffer, and each row's sum of squares over the
    tile to a partials buffer), ``norm`` 1 for the other side of that RMSNorm (the input is h * weight, and the
    epilogue scales each row by its inverse RMS from the partials), ``wtiled`` 1 for weights laid out tile by
    tile (``tile_weight``: a copy)."""
    bn: int
    stages: int
    atoms: int = 1
    nacc: int = 1
    epi: int = 0
    wtiled: int = 0
    norm: int = 0

    def __post_init__(self):
        if self.bn % 8 or not 8 <= self.bn <= 256 or (self.epi == 1 and (self.bn % 16 or self.wtiled)):
            raise ValueError(f"tile rows {self.bn}: a multiple of 8 (16 with the SwiGLU epilogue) up to 256")
        if self.shared_bytes > SHARED_LIMIT or self.stages < 2:
            raise ValueError(f"{self}: two stages or more and at most {SHARED_LIMIT} bytes of shared memory")

    @staticmethod
    def stage_bytes(bn: int, atoms: int) -> int:
        return atoms * (ROWS + bn) * BK * 2

    @property
    def shared_bytes(self) -> int:
        return self.stages * self.stage_bytes(self.bn, self.atoms) + 1024  # + the stages' 1,024-byte alignment

    def __str__(self) -> str:
        extra = ({1: " swiglu", 2: " residual"}.get(self.epi, "") + (" tiled weights" if self.wtiled else "")
                 + (" rms-normed rows" if self.norm else ""))
        return f"{self.bn} rows, {self.stages} stages of {self.atoms * BK} columns, {self.nacc} accumulators{extra}"


_modules: dict = {}


def _function(build: Build):
    """The loaded kernel for ``build`` (compiled once a process)."""
    if build in _modules:
        return _modules[build][1]
    from flared.execution.cuda import cupy

    nvrtc = cupy.cuda.nvrtc

    src = SOURCE.read_text().replace("//@WGMMA@", wgmma_source(build.bn), 1)
    defines = {"BN": build.bn, "STAGES": build.stages, "EPI": build.epi, "ATOMS": build.atoms, "NACC": build.nacc,
               "WTILED": build.wtiled, "NORM": build.norm}
    options = ["-arch=sm_90a", "-std=c++17", "--use_fast_math"] + [f"-D{k}={v}" for k, v in defines.items()]
    prog = nvrtc.createProgram(src, "products64.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"products64.cu ({build}) did not compile:\n{nvrtc.getProgramLog(prog)}") from e
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    module = cupy.cuda.function.Module()
    module.load(cubin)
    fn = module.get_function("flared_products64")
    cupy.cuda.driver.funcSetAttribute(fn.ptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, build.shared_bytes)
    _modules[build] = (module, fn)
    return fn


class Products64:
    """out[rows, n] = x[rows, k] @ W^T for one product shape and build; with ``build.epi`` W is gate_up ([gate
    rows; up rows]) and out[rows, n / 2] = silu(gate) * up."""

    def __init__(self, n: int, k: int, build: Build):
        if k % (BK * build.atoms):
            raise ValueError(f"products64 ({build}) needs the inner size ({k}) a multiple of {BK * build.atoms}")
        if n % build.bn:
            raise ValueError(f"{n} weight rows do not split into tiles of {build.bn}")
        self.n, self.k, self.build = n, k, build
        self.blocks = n // build.bn
        self.out_cols = n // 2 if build.epi == 1 else n
        self._fn = _function(build)

    def weight_map(self, weight: torch.Tensor) -> TensorMap:
        """The map for ``weight`` [n, k] (half-tile boxes for the SwiGLU epilogue); with tiled weights over a
        copy laid out tile by tile (``tile_weight``), which the map keeps."""
        assert tuple(weight.shape) == (self.n, self.k)
        if self.build.epi == 1:
            return TensorMap(weight, self.build.bn // 2)
        if self.build.wtiled:
            return TensorMap(tile_weight(weight, self.build.bn), self.build.bn)
        return TensorMap(weight, self.build.bn)

    def input_map(self, x: torch.Tensor) -> TensorMap:
        assert x.shape[1] == self.k
        return input_map(x)

    def __call__(self, wmap: TensorMap, xmap: TensorMap, out: torch.Tensor, rows: int | None = None, *,
                 part_out: torch.Tensor | None = None, part_in: torch.Tensor | None = None, nparts: int = 0,
                 norm_weight: torch.Tensor | None = None, xw_out: torch.Tensor | None = None, eps: float = 0.0,
                 pdl: bool = False) -> None:
        """Launch on torch's current stream (a graph capture records it). The residual epilogue adds into ``out``
        (h), writes h * ``norm_weight`` [n] to ``xw_out`` and its partial sums of squares to ``part_out``
        [blocks, 64] (float32); the norm side reads ``nparts`` of them from ``part_in``. ``pdl``: a programmatic
        dependent launch."""
        from flared.execution.cuda import launch_kernel

        rows = xmap.tensor.shape[0] if rows is None else rows
        assert out.dtype == torch.bfloat16 and out.is_contiguous() and out.shape[1] == self.out_cols
        assert out.shape[0] >= rows
        if self.build.epi == 2:
            assert part_out is not None and part_out.dtype == torch.float32 and part_out.numel() >= self.blocks * ROWS
            assert norm_weight is not None and norm_weight.dtype == torch.bfloat16 and norm_weight.numel() == self.n
            assert xw_out is not None and xw_out.shape == out.shape and xw_out.dtype == torch.bfloat16
        if self.build.norm:
            assert part_in is not None and part_in.dtype == torch.float32 and part_in.numel() >= nparts * ROWS > 0
        values = [ctypes.c_uint64(out.data_ptr()), ctypes.c_int32(self.out_cols), ctypes.c_int32(rows),
                  ctypes.c_int32(self.k), ctypes.c_uint64(0 if part_out is None else part_out.data_ptr()),
                  ctypes.c_uint64(0 if part_in is None else part_in.data_ptr()), ctypes.c_int32(nparts),
                  ctypes.c_uint64(0 if norm_weight is None else norm_weight.data_ptr()), ctypes.c_float(eps),
                  ctypes.c_uint64(0 if xw_out is None else xw_out.data_ptr())]
        launch_kernel(self._fn.ptr, self.blocks, THREADS, self.build.shared_bytes,
                      torch.cuda.current_stream().cuda_stream, [wmap.param, xmap.param, *map(ctypes.addressof, values)],
                      pdl=pdl)


def input_map(x: torch.Tensor) -> TensorMap:
    """A map over an input buffer [rows <= 64, k] (every product of the same k may share it)."""
    assert x.shape[0] <= ROWS
    return TensorMap(x, ROWS)


def tile_weight(weight: torch.Tensor, bn: int) -> torch.Tensor:
    """[n, k] -> [n / bn * k / 64 * bn, 64]: tile t's 64-column box j at rows (t * k / 64 + j) * bn."""
    n, k = weight.shape
    return weight.view(n // bn, bn, k // BK, BK).permute(0, 2, 1, 3).contiguous().view(-1, BK)


def plan(n: int, k: int, epi: bool, sms: int, tiled: bool = False) -> Build:
    """The build for an [n, k] product on ``sms`` multiprocessors: the tile (a multiple of 8 rows, 16 with the
    SwiGLU epilogue, dividing n) whose waves of blocks stream the fewest rows a block, the fewer waves on a tie;
    stages of 128 columns where k allows (64 with the epilogue's wide tiles), as many as fit; two accumulators
    for tiles of up to 96 rows; with ``tiled``, weights laid out tile by tile (not with the epilogue). (The H200's
    fastest at 8B: 48, 32, 224 and 32 rows for qkv, o, gate_up, down; docs/benchmarks.md, twenty-third session.)"""
    step = 16 if epi else 8
    best = None
    for bn in range(step, 257 if not epi else 225, step):
        if n % bn or (epi and (n // 2) % (bn // 2)):
            continue
        waves = -(-(n // bn) // sms)
        cost = (waves * bn, waves)
        if best is None or cost < best[0]:
            best = (cost, bn)
    if best is None:
        raise ValueError(f"no tile of up to 256 rows divides {n}")
    bn = best[1]
    atoms = 1 if epi or k % (2 * BK) else 2
    stages = min(16, (SHARED_LIMIT - 1024) // Build.stage_bytes(bn, atoms))
    return Build(bn, stages, atoms, 2 if bn <= 96 else 1, epi=int(epi), wtiled=int(tiled and not epi))


def unsupported(model) -> str | None:
    """Why a decoder's layers cannot run their products here, or None."""
    c = model.config
    if model.dtype != torch.bfloat16:
        return "the kernel multiplies bf16"
    layer = model.layers[0]
    if layer.qkv.bias is not None or layer.o.bias is not None:
        return "projection biases"
    if c.hidden_size % BK or (c.num_heads * c.head_dim) % BK or c.intermediate_size % BK:
        return f"inner sizes must be multiples of {BK}"
    return None


class DecoderProducts:
    """The four products of every layer of a Llama-shaped decoder at up to 64 rows (qkv, o, gate_up with its
    SiLU-mul, down): one build per product shape and one weight map per layer and product, made once. With
    ``tiled``, qkv, o and down read copies of their weights laid out tile by tile (``tile_weight``: another
    6.4 GB at 8B), which the H200 streamed faster (docs/benchmarks.md, twenty-third session).

    With ``fold_norms`` the layer's two add_rms_norm launches go: o and down add into the residual stream h, write
    h times the next RMSNorm's weight for the next product to read, and leave each row's partial sums of squares
    (``partials``), from which gate_up and the next layer's qkv scale their rows (``qkv`` keeps a plain build for
    layer 0, whose input the step norms). With ``pdl`` every launch is a programmatic dependent one: a product
    streams its first weights while the kernel before it finishes."""

    def __init__(self, model, sms: int, tiled: bool = False, fold_norms: bool = False, pdl: bool = False):
        c = model.config
        nh_d = c.num_heads * c.head_dim
        shapes = {"qkv": (nh_d + 2 * c.num_kv_heads * c.head_dim, c.hidden_size), "o": (c.hidden_size, nh_d),
                  "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}
        builds = {p: plan(n, k, p == "gate_up", sms, tiled) for p, (n, k) in shapes.items()}
        self.fold_norms, self.pdl, self.eps = fold_norms, pdl, c.rms_norm_eps
        if fold_norms:
            builds["qkv_norm"] = replace(builds["qkv"], norm=1)
            builds["gate_up"] = replace(builds["gate_up"], norm=1)
            builds["o"] = replace(builds["o"], epi=2)
            builds["down"] = replace(builds["down"], epi=2)
        self.products = {p: Products64(*shapes[p.removesuffix("_norm")], b) for p, b in builds.items()}
        self.maps = [{p: self.products[p].weight_map(getattr(layer, p).weight) for p in shapes}
                     for layer in model.layers]
        self.nparts = max(self.products["o"].blocks, self.products["down"].blocks)
        device = model.layers[0].qkv.weight.device
        self.partials = torch.zeros(self.nparts, ROWS, dtype=torch.float32, device=device) if fold_norms else None

    def __call__(self, product: str, layer: int, xmap: TensorMap, out: torch.Tensor,
                 norm_weight: torch.Tensor | None = None, xw: torch.Tensor | None = None,
                 normed: bool = False) -> torch.Tensor:
        """``product`` of ``layer``: out = x @ W^T (gate_up: its SiLU-mul). With ``fold_norms``, o and down add
        into ``out`` (h) and write h * ``norm_weight`` to ``xw``, and qkv past layer 0 (``normed``) and gate_up
        read that and scale their rows."""
        build = "qkv_norm" if product == "qkv" and normed else product
        kernel = self.products[build]
        parts = {}
        if kernel.build.epi == 2:
            parts = {"part_out": self.partials, "norm_weight": norm_weight, "xw_out": xw}
        elif kernel.build.norm:
            source = self.products["down" if product == "qkv" else "o"]
            parts = {"part_in": self.partials, "nparts": source.blocks, "eps": self.eps}
        kernel(self.maps[layer][product], xmap, out, pdl=self.pdl, **parts)
        return out

    input_map = staticmethod(input_map)
