"""The dtype the daemon serves the embedded model in when none is asked for (``flared run --dtype auto``)."""

from __future__ import annotations

from flared.core.default import ensure_default_core, preferred_dtype
from flared.core.manifest import read_manifest


def test_auto_exports_the_embedded_model_in_the_preferred_dtype(default_gguf, tmp_path):
    core = ensure_default_core(tmp_path, "auto")
    assert preferred_dtype() in ("float32", "bfloat16")
    assert read_manifest(core).dtype == preferred_dtype()
    assert core.name.endswith("-" + preferred_dtype())
    # Asking again finds the same core instead of exporting another.
    assert ensure_default_core(tmp_path, preferred_dtype()) == core
