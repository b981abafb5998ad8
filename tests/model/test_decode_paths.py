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
