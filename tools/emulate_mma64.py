"""probe_mma64.py's kernel, its index arithmetic emulated in numpy: which weight and input values each lane's
mma.sync fragments hold (the PTX ISA's m16n8k16 layouts), the k permutation, the shared-memory swizzle and the
split reduction, checked against X @ W^T on small shapes. It runs without a GPU: a check of the kernel's
indexing before its first device run, not of the hardware.

    python tools/emulate_mma64.py
"""
import numpy as np
WARPS, KB = 16, 64
def mma(c, A, B):  # A: 32 lanes x 8 vals (a0..a7), B: 32 x 4 (b0..b3); c: 32 x 4  -> standard m16n8k16 semantics
    Am = np.zeros((16, 16)); Bm = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(8):
            Am[g + 8 * ((i // 2) % 2), 2 * t + (i % 2) + 8 * (i // 4)] = A[lane][i]
        for i in range(4):
            Bm[2 * t + (i % 2) + 8 * (i // 2), g] = B[lane][i]
    D = Am @ Bm
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(4):
            c[lane][i] += D[g + 8 * (i // 2), 2 * t + (i % 2)]
def run(N, K, S, G, PD=2, STAGES=3):
    rng = np.random.default_rng(0)
    W = rng.standard_normal((N, K)); X = rng.standard_normal((64, K)); Y = np.zeros((64, N))
    T = N // 16; slots = WARPS // S; Ks = K // S; nkb = Ks // KB
    for b in range(G):
        # smem stage contents: we emulate load_x + swizzled reads directly
        xs_all = {}
        for c in range(nkb):
            st = np.zeros((S, 64, KB // 8, 8))
            for sp in range(S):
                for row in range(64):
                    for ci in range(KB // 8):
                        st[sp, row, ci ^ (row & 7)] = X[row, sp * Ks + c * KB + ci * 8: sp * Ks + c * KB + ci * 8 + 8]
            xs_all[c] = st
        red = np.zeros((WARPS, 16, 64))
        accs = {}
        for warp in range(WARPS):
            slot, s = warp // S, warp % S
            tile = b + slot * G
            active = slot < slots and tile < T
            acc = np.zeros((8, 32, 4))
            if active:
                for c in range(nkb):
                    for j in range(8):
                        Bs = [[[0]*4 for _ in range(32)] for _ in range(4)]
                        As = [[[0]*8 for _ in range(32)] for _ in range(4)]
                        for lane in range(32):
                            g, q = lane >> 2, lane & 3
                            base = s * Ks + c * KB + q * 16
                            wa = W[tile * 16 + g, base: base + 16]; wb = W[tile * 16 + g + 8, base: base + 16]
                            n = j * 8 + g
                            x0 = xs_all[c][s, n, (2 * q) ^ (n & 7)]; x1 = xs_all[c][s, n, (2 * q + 1) ^ (n & 7)]
                            xv = np.concatenate([x0, x1])
                            for t in range(4):  # step t: regs (wa[4t:4t+2], wb[4t:4t+2], wa[4t+2:4t+4], wb[..])
                                As[t][lane] = [wa[4*t], wa[4*t+1], wb[4*t], wb[4*t+1],
                                               wa[4*t+2], wa[4*t+3], wb[4*t+2], wb[4*t+3]]
                                Bs[t][lane] = [xv[4*t], xv[4*t+1], xv[4*t+2], xv[4*t+3]]
                        for t in range(4):
                            mma(acc[j], As[t], Bs[t])
            accs[warp] = (acc, active, tile)
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                for j in range(8):
                    n = j * 8 + 2 * q
                    red[warp, g, n] = acc[j][lane][0]; red[warp, g, n + 1] = acc[j][lane][1]
                    red[warp, g + 8, n] = acc[j][lane][2]; red[warp, g + 8, n + 1] = acc[j][lane][3]
        for e in range(slots * 16 * 64):
            sl, rr, n = e // (16 * 64), (e // 64) % 16, e % 64
            t = b + sl * G
            if t >= T: continue
            Y[n, t * 16 + rr] = sum(red[sl * S + sp, rr, n] for sp in range(S))
    ref = X @ W.T
    return np.abs(Y - ref).max() / np.abs(ref).max()
print("S=1", run(N=64, K=128, S=1, G=2))
print("S=2", run(N=64, K=256, S=2, G=2))
print("S=4 uneven tiles", run(N=96, K=512, S=4, G=4))
