"""The GPU sampling kernels (flared/model/kernels/sampling.py) compile for a Hopper target, without a GPU: Triton's
code generator refuses what its interpreter runs (a kernel reading a global that is not a constexpr), so the
interpreter-run checks and a CPU machine would not see such a kernel fail. Skips where Triton is not installed."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")


def _compile(fn, names_types: str, constexprs: dict):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(pair.split(":") for pair in names_types.split())
    sig.update({name: "constexpr" for name in constexprs})
    return triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))


PARTS = ("Logits:*fp32 Temperature:*fp32 Seeds:*i64 Steps:*i64 PartVal:*fp32 PartIdx:*i32 TopK:*i32 TopP:*fp32 "
         "MinP:*fp32 Chain:*i32 Scores:*fp32 PartMax:*fp32 PartSum:*fp32 Tops:*fp32 Taken:*i32 Slots:*i32 "
         "Counts:*i32 Prompt:*u8 Bias:*fp32 Params:*fp32 Bans:*i32 Grammar:*i32 Masks:*i32 vocab:i32 chunk:i32 "
         "n_chunks:i32 stride:i32")
PICK = ("PartVal:*fp32 PartIdx:*i32 Out:*i64 Slots:*i32 Counts:*i32 Window:*i32 Ring:*i32 Lens:*i64 vocab:i32 "
        "n_chunks:i32")
WALK = ("Logits:*fp32 Scores:*fp32 Temperature:*fp32 TopK:*i32 TopP:*fp32 MinP:*fp32 Chain:*i32 PartVal:*fp32 "
        "PartIdx:*i32 PartMax:*fp32 PartSum:*fp32 Tops:*fp32 Kept:*fp32 Taken:*i32 Out:*i64 Passes:*i32 Slots:*i32 "
        "Counts:*i32 Window:*i32 Ring:*i32 Lens:*i64 vocab:i32 n_chunks:i32 n_tops:i32 stride:i32")


@pytest.mark.parametrize("full, j", [(False, 1), (True, 4)])
@pytest.mark.parametrize("shape", [False, True])  # rows shaped by the Sampler's bias and penalty tables
@pytest.mark.parametrize("chain", [False, True])  # rows of llama.cpp's chain beside vLLM's order
def test_the_race_compiles(full, j, shape, chain):
    from flared.model.kernels import sampling

    kernel = _compile(sampling._race_parts_kernel, PARTS, {"BLOCK": sampling.RACE_BLOCK, "FULL": full, "J": j,
                                                           "SHAPE": shape, "CHAIN": chain,
                                                           "TOPS_PER": 16 if full else 0, "BANS": 8})
    assert "ptx" in kernel.asm


@pytest.mark.parametrize("shape", [False, True])
def test_the_pick_compiles(shape):
    from flared.model.kernels import sampling

    kernel = _compile(sampling._race_pick_kernel, PICK, {"PARTS": 64, "SHAPE": shape, "RING": 1024})
    assert "ptx" in kernel.asm


@pytest.mark.parametrize("shape", [False, True])
@pytest.mark.parametrize("chain", [False, True])
def test_the_walk_compiles(shape, chain):
    from flared.model.kernels import sampling

    kernel = _compile(sampling._walk_kernel, WALK, {"PARTS": 64, "BLOCK": sampling.WALK_BLOCK,
                                                     "LIST": sampling.LIST_BLOCK, "J": sampling.CANDIDATES,
                                                     "SHAPE": shape, "RING": 1024, "CHAIN": chain,
                                                     "TOPS": 256, "KEPT": sampling.KEPT})
    assert "ptx" in kernel.asm


def test_the_logprobs_kernels_compile():
    from flared.model.kernels import sampling

    rows = "Logits:*fp32 Args:*i64 "
    kernels = [
        _compile(sampling._logprob_parts_kernel, rows + "PartMax:*fp32 PartSum:*fp32 Tops:*fp32 Taken:*i32 stride:i32 "
                 "vocab:i32 chunk:i32 n_chunks:i32 cap:i32", {"BLOCK": sampling.RACE_BLOCK, "TOPS_PER": 8}),
        _compile(sampling._logprob_copy_kernel, rows + "Tops:*fp32 Taken:*i32 KeptV:*fp32 KeptI:*i32 stride:i32 "
                 "vocab:i32 chunk:i32 n_tops:i32 cap:i32", {"BLOCK": sampling.RACE_BLOCK, "TOPS": 256,
                                                           "KEPT": sampling.KEPT}),
        _compile(sampling._logprob_rank_kernel, rows + "Sampled:*i64 PartMax:*fp32 PartSum:*fp32 Taken:*i32 "
                 "KeptV:*fp32 KeptI:*i32 OutF:*fp32 OutI:*i32 stride:i32 vocab:i32 n_chunks:i32 cap:i32",
                 {"PARTS": 32, "BLOCK": sampling.LOGPROB_BLOCK, "KEPT": sampling.KEPT, "MAXN": sampling.GRAPH_LOGPROBS,
                  "RANKED": sampling.LOGPROB_RANKED}),
    ]
    assert all("ptx" in k.asm for k in kernels)


def test_the_drawn_rows_placing_kernel_compiles():
    from flared.model.kernels import sampling

    kernel = _compile(sampling._place_drawn_kernel, "Tokens:*i64 Args:*i64 Sampled:*i64 LastToken:*i64 cap:i32", {})
    assert "ptx" in kernel.asm
