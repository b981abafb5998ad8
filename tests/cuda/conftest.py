"""GPU qualification tests: skipped unless torch sees a CUDA device and CuPy and Triton import."""

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # gpu_models, for the shared fixtures below


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


@pytest.fixture(scope="module")
def hf():
    """A small random-weight Llama (tests/cuda/gpu_models.py), on the GPU."""
    from gpu_models import tiny_hf

    return tiny_hf()


@pytest.fixture(scope="module")
def gpu_model(hf):
    """flared's DecoderModel over the same weights, on the GPU."""
    from gpu_models import serving_model

    return serving_model(hf)
