"""The dtype the daemon serves the embedded model in when none is asked for."""

from __future__ import annotations

from flared.core.default import cpu_has_bf16, default_core_dir, preferred_dtype


def test_preferred_dtype_follows_the_hardware():
    import torch

    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    assert cpu_has_bf16() == native
    expected = "bfloat16" if torch.cuda.is_available() or native else "float32"
    assert preferred_dtype() == expected


def test_default_core_dir_names_the_dtype(tmp_path):
    assert default_core_dir(tmp_path, "bfloat16").name.endswith("-bfloat16")
    assert default_core_dir(tmp_path, "float32") != default_core_dir(tmp_path, "bfloat16")
