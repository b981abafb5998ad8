"""What the 64-row product probes share (probe_gemm64, probe_pdl_gemm64, probe_lt_algos, probe_l2_sidecar):
Llama-3.1-8B's four per-layer products, their operands with every layer's weights distinct (as a real step
streams them: nothing stays in L2 between layers), graph timing and the table."""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

H, I, V, NQKV = 4096, 14336, 128256, 6144
PRODUCTS = {"qkv": (NQKV, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I)}  # name: (rows n, k)


def probe_parser(rows: bool = False) -> argparse.ArgumentParser:
    """The options every product probe takes: --layers (32), --json, and with ``rows`` --rows (64)."""
    ap = argparse.ArgumentParser()
    if rows:
        ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    return ap


def operands(m: int, layers: int, dtype=torch.bfloat16):
    """Seeded random weights per product and layer (w[p][layer] [n, k]), inputs x[p] [m, k], outputs y[p]."""
    torch.manual_seed(0)
    w = {p: [(0.02 * torch.randn(n, k, device="cuda")).to(dtype) for _ in range(layers)]
         for p, (n, k) in PRODUCTS.items()}
    x = {p: torch.randn(m, k, device="cuda").to(dtype) for p, (n, k) in PRODUCTS.items()}
    y = {p: torch.empty(m, n, device="cuda", dtype=dtype) for p, (n, k) in PRODUCTS.items()}
    return w, x, y


def chain_gb(layers: int, head: bool = False) -> float:
    """Weight GB a chain of `layers` x the four products (and the LM head) streams."""
    return (sum(n * k for n, k in PRODUCTS.values()) * layers + (V * H if head else 0)) * 2 / 1e9


def graph_us(fn, replays: int = 10) -> float:
    from flared.execution.graphs import time_graph_us

    return time_graph_us(fn, torch.cuda.Stream(), replays=replays)


def torch_layer_us(x: dict, w: dict, y: dict, p: str) -> float:
    """GPU microseconds a layer of product ``p`` through torch (``F.linear``; cuBLASLt where preferred), over
    every layer's weights in one graph."""
    layers = len(w[p])
    return graph_us(lambda: [torch.nn.functional.linear(x[p], w[p][i], out=y[p]) for i in range(layers)]) / layers


def cublaslt_reference(x: dict, w: dict, y: dict, p: str) -> tuple[float, torch.Tensor, float, tuple]:
    """Product ``p``'s weight MB, torch's float32 result on layer 0 (what a kernel is checked against), torch's
    us per layer, and that timing's table row."""
    n, k = PRODUCTS[p]
    mb = n * k * 2 / 1e6
    ref = torch.nn.functional.linear(x[p], w[p][0]).float()
    lt = torch_layer_us(x, w, y, p)
    return mb, ref, lt, (p, "cuBLASLt", lt, mb / lt, "")


def launch(function, blocks: int, threads: int, shared: int, values: list) -> None:
    """A CuPy-loaded kernel (``RawModule.get_function``) on torch's current stream (so a torch graph capture
    records it); ``values`` are the kernel's arguments as ctypes scalars."""
    from flared.execution.cuda import launch_kernel

    launch_kernel(function.kernel.ptr, blocks, threads, shared, torch.cuda.current_stream().cuda_stream,
                  [ctypes.addressof(v) for v in values])


def time_variants(variants: str, time_one) -> dict[str, float]:
    """``time_one(name)`` for each of the comma-separated variants, then for the first again (the drift between the
    ends), that one under "<name> (again)"; in run order."""
    names = [v.strip() for v in variants.split(",") if v.strip()]
    res: dict[str, float] = {}
    for name in names + [names[0]]:
        res[name if name not in res else name + " (again)"] = time_one(name)
    return res


def print_rows(rows, what: str = "backend", width: int = 9, digits: int = 1) -> None:
    """rows: (product, name, us per layer, TB/s, note)."""
    print(f"{'product':8} {what:{width}} {'us/layer':>10} {'TB/s':>6}  note")
    for p, name, us, tbs, note in rows:
        print(f"{p:8} {name:{width}} {us:10.{digits}f} {tbs:6.2f}  {note}")


def finish(rows, out: dict, ok: bool, as_json: bool, wrong: str, what: str = "backend", width: int = 9) -> int:
    """The probe's table, ``wrong`` where a kernel disagreed with torch (its timings then mean nothing), its
    figures as one JSON line with ``as_json``; the exit status (1 when something disagreed)."""
    print_rows(rows, what=what, width=width)
    if not ok:
        print(wrong)
    if as_json:
        import json

        print(json.dumps(out))
    return 0 if ok else 1
