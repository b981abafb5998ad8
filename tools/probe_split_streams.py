"""The 8B step's 64-row products cut along their output rows into pieces launched side by side on parallel
branches of one graph, against one cuBLASLt launch per product (written in the thirteenth session; run in the
fourteenth: every cut lost to one launch, docs/benchmarks.md).

cuBLASLt tiles qkv, o and down so that 86-96 of the H200's 132 multiprocessors have a block
(tools/probe_lt_algos.py, twelfth session) and the rest stream nothing: qkv and o reach ~3 TB/s, down ~3.7,
where a plain read of the same bytes reaches 4.1-4.5 (tools/probe_read_floor.py). A second launch on another
stream can only place its blocks on multiprocessors the first leaves free, so a product cut into pieces whose
tile counts add up to about one block per multiprocessor might fill the chip without any kernel of ours.

Each product is timed over every layer's distinct weights (nothing stays in L2), per cut:
- ``one``: one launch (the reference);
- ``a : b [: c]``: the weight rows cut in that ratio (pieces rounded to 64 rows), the first piece on the
  capturing stream, the others on side streams that fork from it and join it again;
- ``... in order``: the same pieces one after another on one stream (what cutting alone costs).
Each piece writes its own output (the decode step would need the pieces' outputs side by side; a strided
variant, ``... strided``, writes column slices of one output through ``torch.mm(out=...)``).
The chain (32 layers x 4 products) then runs with each product's fastest cut against one launch each.

    python tools/probe_split_streams.py [--rows 64] [--layers 32] [--json]

CUDA only; a probe for deciding whether the 64-row decode graph should fork its products.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from products64 import PRODUCTS, chain_gb, finish, graph_us, operands, probe_parser  # noqa: E402

# name: (ratios of the pieces, side by side?, strided output?)
CUTS = {
    "one": ((1,), False, False),
    "1 : 1": ((1, 1), True, False),
    "1 : 1 in order": ((1, 1), False, False),
    "3 : 1": ((3, 1), True, False),
    "8 : 3": ((8, 3), True, False),  # ~96 : 36 multiprocessors
    "2 : 1": ((2, 1), True, False),
    "1 : 1 : 1": ((1, 1, 1), True, False),
    "3 : 1 strided": ((3, 1), True, True),
}


def pieces(n: int, ratios: tuple) -> list[tuple[int, int]]:
    """Row ranges [a, b) of an n-row weight cut in ``ratios``, each a multiple of 64 rows (the last takes the
    rest)."""
    total, bounds, acc = sum(ratios), [0], 0
    for r in ratios[:-1]:
        acc += r
        bounds.append(max(bounds[-1] + 64, round(n * acc / total / 64) * 64))
    bounds.append(n)
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cannot cut {n} rows as {ratios}")
    return list(zip(bounds, bounds[1:]))


class Forked:
    """One product cut into pieces: ``run(x, w, layer)`` enqueues the pieces (forked onto side streams when
    side by side) and joins them back into the current stream."""

    def __init__(self, x: torch.Tensor, n: int, ratios: tuple, parallel: bool, strided: bool,
                 sides: list[torch.cuda.Stream]):
        self.ranges = pieces(n, ratios)
        self.parallel, self.strided = parallel, strided
        self.sides = sides[:len(self.ranges) - 1]
        m = x.shape[0]
        if strided:
            self.out = torch.empty(m, n, device=x.device, dtype=x.dtype)
            self.outs = [self.out[:, a:b] for a, b in self.ranges]
        else:
            self.outs = [torch.empty(m, b - a, device=x.device, dtype=x.dtype) for a, b in self.ranges]

    def _piece(self, x, w, j):
        a, b = self.ranges[j]
        if self.strided:
            torch.mm(x, w[a:b].t(), out=self.outs[j])
        else:
            torch.nn.functional.linear(x, w[a:b], out=self.outs[j])

    def run(self, x: torch.Tensor, w: torch.Tensor) -> None:
        if not self.parallel:
            for j in range(len(self.ranges)):
                self._piece(x, w, j)
            return
        main = torch.cuda.current_stream()
        for s in self.sides:
            s.wait_stream(main)
        for j, s in enumerate(self.sides, start=1):
            with torch.cuda.stream(s):
                self._piece(x, w, j)
        self._piece(x, w, 0)
        for s in self.sides:
            main.wait_stream(s)

    def matches(self, x: torch.Tensor, w: torch.Tensor) -> float:
        """Largest relative difference of the pieces' outputs from one F.linear over the whole weight."""
        ref = torch.nn.functional.linear(x, w).float()
        got = torch.cat([o.float() for o in self.outs], dim=1)
        return ((got - ref).abs().max() / ref.abs().max()).item()


def main(argv=None) -> int:
    ap = probe_parser(rows=True)
    ap.add_argument("--cuts", default=",".join(CUTS), help="names from CUTS, comma separated")
    args = ap.parse_args(argv)
    L = args.layers
    torch.backends.cuda.preferred_blas_library("cublaslt")
    w, x, _ = operands(args.rows, L)
    sides = [torch.cuda.Stream() for _ in range(2)]
    rows, out, ok = [], {"rows": args.rows, "layers": L}, True
    best = {}
    for p, (n, k) in PRODUCTS.items():
        mb = n * k * 2 / 1e6
        out[p] = {}
        for name in args.cuts.split(","):
            ratios, parallel, strided = CUTS[name]
            try:
                f = Forked(x[p], n, ratios, parallel, strided, sides)
            except ValueError as e:
                rows.append((p, name, float("nan"), float("nan"), str(e)))
                continue
            us = graph_us(lambda f=f, p=p: [f.run(x[p], w[p][i]) for i in range(L)]) / L
            torch.cuda.synchronize()
            f.run(x[p], w[p][0])
            torch.cuda.synchronize()
            err = f.matches(x[p], w[p][0])
            good = err < 1e-2
            ok &= good
            note = " + ".join(str(b - a) for a, b in f.ranges) + " rows" + ("" if good else f" WRONG ({err:.1e})")
            rows.append((p, name, us, mb / us, note))
            out[p][name] = round(us, 2)
            if good and (p not in best or us < best[p][1]):
                best[p] = (f, us, name)
    gb = chain_gb(L)
    ones = {p: Forked(x[p], n, (1,), False, False, sides) for p, (n, k) in PRODUCTS.items()}

    def chain(forks):
        return lambda: [forks[p].run(x[p], w[p][i]) for i in range(L) for p in PRODUCTS]

    fastest = {p: best[p][0] for p in PRODUCTS}
    note = ", ".join(f"{p} {best[p][2]}" for p in PRODUCTS)
    for name, forks, extra in (("one each", ones, ""), ("fastest cuts", fastest, note), ("one each (again)", ones, "")):
        us = graph_us(chain(forks), replays=5)
        rows.append(("chain", name, us, gb / us * 1e3, extra or f"{gb:.2f} GB"))
        out[f"chain {name}"] = round(us, 1)
    return finish(rows, out, ok, args.json, "a cut's output disagrees with one launch: its timing means nothing "
                  "until that is fixed", what="cut", width=16)


if __name__ == "__main__":
    sys.exit(main())
