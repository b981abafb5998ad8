"""GPU qualification tests: skipped unless torch sees a CUDA device and CuPy and Triton import."""

import importlib.util

import pytest


def _gpu_ready() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    for name in ("cupy", "triton"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed"
    return None


_WHY = _gpu_ready()


def pytest_collection_modifyitems(config, items):
    if _WHY is None:
        return
    skip = pytest.mark.skip(reason=f"GPU qualification: {_WHY}")
    for item in items:
        if "tests/cuda/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
