"""The 64-row step's attention with the o projection's weights pulled into L2 beside it (EXPERIMENT: written
without a GPU in the sixteenth session; not yet run).

At 64 rows and 256 tokens decode attention streams its layer's 67 MB of K/V at ~3 TB/s (22.5 us a layer,
tools/probe_decode_attention.py), so about a quarter of the H200's bandwidth sits idle while it runs. The o
projection after it streams 34 MB of weights at ~2.9 TB/s (11.8 us, cuBLASLt). Weights do not depend on the
step, so a parallel branch of the graph can prefetch the o weights into L2 while attention runs, and the o
product then reads them from L2. (Prefetching the next product's weights while a product runs lost,
tools/probe_l2_sidecar.py: the products leave no bandwidth idle.)

Every layer has its own K/V pool and o weights (32 layers: nothing stays in L2 between steps); each variant
captures attention + o for all layers in one graph:

- ``none``: attention, then o (the reference);
- ``F lines[ last][ B blocks][ nojoin]``: a side branch forks as attention starts and prefetches the first F of
  every o weight row, one ``prefetch.global.L2`` per 128-byte line (``evict_last`` with ``last``) from B blocks
  (default 16); it joins before the o product, or with ``nojoin`` only after the last layer;
- ``attention``, ``o``: each alone, for scale.

    python tools/probe_attn_prefetch.py [--rows 64] [--context 256] [--layers 32] [--json]

CUDA only; a probe for deciding whether the 64-row decode graph should carry such a branch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from probe_decode_attention import attention_operands  # noqa: E402
from probe_l2_sidecar import Prefetcher  # noqa: E402
from products64 import graph_us, probe_parser, time_variants  # noqa: E402

VARIANTS = {
    "none": None,
    "1 lines last": {"rows": 1.0, "how": "lines last"},
    "1 lines": {"rows": 1.0, "how": "lines"},
    "1/2 lines last": {"rows": 0.5, "how": "lines last"},
    "3/4 lines last": {"rows": 0.75, "how": "lines last"},
    "1 lines last 64 blocks": {"rows": 1.0, "how": "lines last", "blocks": 64},
    "1 lines last 4 blocks": {"rows": 1.0, "how": "lines last", "blocks": 4},
    "1 lines last nojoin": {"rows": 1.0, "how": "lines last", "nojoin": True},
    "1/2 bulk": {"rows": 0.5, "how": "bulk"},
}


def main(argv=None) -> int:
    from flared.model.triton_attention import paged_decode_attention_rope

    ap = probe_parser(rows=True)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    B, ctx, L, H = args.rows, args.context, args.layers, 4096
    torch.backends.cuda.preferred_blas_library("cublaslt")
    op = attention_operands(B, ctx, L)
    nh, nkv, d, P, dt = op.nh, op.nkv, op.d, op.page, op.dt
    attn = torch.empty(B, nh, d, device="cuda", dtype=dt)
    wo = [(0.02 * torch.randn(H, nh * d, device="cuda")).to(dt) for _ in range(L)]
    y = torch.empty(B, H, device="cuda", dtype=dt)
    scale = d ** -0.5
    pre = Prefetcher()
    side = torch.cuda.Stream()

    def attention(i):
        paged_decode_attention_rope(op.qkv, op.cos, op.sin, op.positions, op.slots, op.k_pool[i], op.v_pool[i], attn,
                                    op.tables, op.lens, num_heads=nh, page_tokens=P, scale=scale)

    def o(i):
        torch.nn.functional.linear(attn.view(B, nh * d), wo[i], out=y)

    def chain(spec):
        def fn():
            main = torch.cuda.current_stream()
            for i in range(L):
                if spec is not None:
                    side.wait_stream(main)  # the branch starts with attention
                    with torch.cuda.stream(side):
                        pre(wo[i], spec)
                attention(i)
                if spec is not None and not spec.get("nojoin"):
                    main.wait_stream(side)
                o(i)
            if spec is not None:
                main.wait_stream(side)
        return fn

    kv_mb = B * ctx * nkv * d * 2 * 2 / 1e6
    o_mb = H * nh * d * 2 / 1e6
    res = {"attention": graph_us(lambda: [attention(i) for i in range(L)]) / L,
           "o": graph_us(lambda: [o(i) for i in range(L)]) / L}
    timed = time_variants(args.variants, lambda name: graph_us(chain(VARIANTS[name]), replays=10) / L)
    base = next(iter(timed.values()))
    res.update(timed)
    print(f"{B} rows, context {ctx}: {kv_mb:.1f} MB of K/V and {o_mb:.1f} MB of o weights a layer")
    print(f"{'variant':28} {'us/layer':>9} {'vs first':>9}")
    for name, us in res.items():
        print(f"{name:28} {us:9.2f} {us - base:+9.2f}")
    if args.json:
        print(json.dumps({"rows": B, "context": ctx, "us_per_layer": {k: round(v, 2) for k, v in res.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
