"""What products64 (the Hopper decode products) decides on the host, which needs no GPU: the tile each product
shape gets, the builds it refuses, the tile-by-tile weight layout and the wgmma step it generates."""

import pytest

torch = pytest.importorskip("torch")

from flared.model.kernels import products64  # noqa: E402


@pytest.mark.parametrize("n, k, epi, tile, atoms", [
    (6144, 4096, False, 48, 2),  # Llama-3.1-8B: 128 blocks each on 132 multiprocessors
    (4096, 4096, False, 32, 2),
    (28672, 4096, True, 224, 1),  # the SwiGLU epilogue: 112 gate rows and their 112 up rows a tile
    (4096, 14336, False, 32, 2),
    (960, 576, False, 8, 1),  # SmolLM2-135M: 576 columns take 64-column stages
    (3072, 576, True, 32, 1),  # 96 tiles in one wave rather than 192 tiles of 16 in two
])
def test_plan_covers_the_chip_once_with_the_smallest_tile(n, k, epi, tile, atoms):
    build = products64.plan(n, k, epi, 132)
    assert (build.bn, build.atoms, build.epi) == (tile, atoms, int(epi))
    assert n // build.bn <= 132 and build.shared_bytes <= products64.SHARED_LIMIT
    assert build.stages >= 2 and build.nacc == (2 if tile <= 96 else 1) and not build.wtiled
    # tile-by-tile weight copies: every product but gate_up (its gate and up halves come from two places)
    assert products64.plan(n, k, epi, 132, tiled=True).wtiled == int(not epi)


def test_plan_refuses_a_size_no_tile_divides():
    with pytest.raises(ValueError, match="no tile"):
        products64.plan(1001, 4096, False, 132)


def test_builds_refuse_what_the_kernel_cannot_do():
    with pytest.raises(ValueError, match="multiple of 8"):
        products64.Build(12, 4)
    with pytest.raises(ValueError, match="16 with the SwiGLU"):
        products64.Build(24, 4, epi=1)
    with pytest.raises(ValueError, match="shared memory"):
        products64.Build(256, 16, atoms=2)
    with pytest.raises(ValueError, match="two stages"):
        products64.Build(32, 1)


def test_tile_weight_puts_each_tiles_boxes_in_one_run():
    w = torch.arange(96 * 256).view(96, 256)
    t = products64.tile_weight(w, 32)
    assert t.shape == (96 * 256 // 64, 64)
    for tile in range(3):
        for box in range(4):
            start = (tile * 4 + box) * 32
            assert torch.equal(t[start:start + 32], w[tile * 32:(tile + 1) * 32, box * 64:(box + 1) * 64])


def test_wgmma_step_binds_half_the_tile_as_accumulators():
    src = products64.wgmma_source(48)
    assert "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16" in src
    assert src.count('"+f"(d[') == 24 and "%24, %25" in src
