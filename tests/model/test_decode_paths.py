"""The startup log's line on which kernels serve decode steps (flared.model.kernels.megakernel)."""

from flared.model.kernels.megakernel import describe_decode_paths


def test_each_path_and_its_row_limit_is_named():
    line = describe_decode_paths(skinny_max_rows=16, mega_max_rows=8, mega_max_context=1024,
                                 calibration={"mega_us": {1: 449.0}})
    assert line == ("decode: megakernel up to 8 rows while contexts are <= 1024 tokens, skinny kernels up to 16 "
                    "rows, cuBLAS + fused kernels beyond")
    assert describe_decode_paths(skinny_max_rows=0, mega_max_rows=0, mega_max_context=1024,
                                 calibration={}) == "decode: cuBLAS + fused kernels"


def test_the_rows_with_the_tagged_word_exchange_are_named():
    line = describe_decode_paths(skinny_max_rows=0, mega_max_rows=4, mega_max_context=1024,
                                 calibration={"mega_us": {1: 449.0}, "mega_ll_rows": [1, 2]})
    assert line == ("decode: megakernel up to 4 rows (tagged-word exchange at 1, 2 rows) while contexts are <= 1024 "
                    "tokens, cuBLAS + fused kernels beyond")


def test_a_megakernel_that_failed_to_build_says_why():
    line = describe_decode_paths(skinny_max_rows=16, mega_max_rows=0, mega_max_context=1024,
                                 calibration={"megakernel_error": "CompileException: nvrtc: error"})
    assert line == "decode: skinny kernels up to 16 rows, cuBLAS + fused kernels beyond; megakernel off: " \
                   "CompileException: nvrtc: error"


def _shape(hidden, intermediate, heads, kv_heads, head_dim):
    """A model as the megakernel's sizing reads it: only its config."""
    from types import SimpleNamespace

    from flared.model.config import ModelConfig

    return SimpleNamespace(config=ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=hidden, intermediate_size=intermediate, num_layers=32,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=5e5,
        rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=False, attention_bias=False,
        qk_norm=False))


def test_the_resident_attention_build_fits_its_keys_in_shared_memory():
    """Llama-3.1-8B at one row on an H200 (227 KB a block): 272 keys resident in a 194,288-byte block (under the
    196 KB carve-out), 48 more in the product-input buffer during attention, so contexts to 320 tokens; the
    layout's sum is what the launch asks."""
    from flared.model.kernels import megakernel

    llama8b = _shape(4096, 14336, 32, 8, 128)
    assert megakernel.resident(llama8b, 1, False)
    assert not megakernel.resident(llama8b, 2, False) and not megakernel.resident(llama8b, 1, True)
    cap = megakernel.resident_cap(llama8b, megakernel.THREADS, 232448)
    assert (cap, megakernel.resident_tail(llama8b)) == (272, 48)
    total = megakernel.shared_bytes(llama8b, 1, megakernel.THREADS, res_cap=cap)
    # the non-resident layout with the product inputs only (no V staging), rounded to 16, then K and V rows
    plain = megakernel.shared_bytes(llama8b, 1, megakernel.THREADS)
    assert total == -(-(plain - (16 * 32 * 128 - 14336) * 2) // 16) * 16 + 4 * 272 * 128 == 194288
    assert total <= megakernel.RESIDENT_SHARED_BYTES
    # the region is at least the split path's staged V tiles (128 KB at 8B): a block that cannot hold those
    # holds no resident keys either
    assert megakernel.resident_cap(llama8b, megakernel.THREADS, total - 1) == 256
    smallest = megakernel.shared_bytes(llama8b, 1, megakernel.THREADS, res_cap=256)
    assert megakernel.resident_cap(llama8b, megakernel.THREADS, smallest - 1) == 0
    # short-row models (SmolLM2-135M) keep the split attention: their step is latency-bound, not per-block bound
    assert not megakernel.resident(_shape(576, 1536, 9, 3, 64), 1, False)
    # more than 16 query heads per kv head do not fit the 16-row operand
    assert not megakernel.resident(_shape(4096, 14336, 32, 1, 128), 1, False)
