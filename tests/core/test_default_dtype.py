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


def test_an_embedded_core_from_before_the_gguf_types_were_recorded_is_exported_again(default_gguf, tmp_path):
    """The embedded model's cached core records its GGUF's tensor types (for -q gguf); one written before that is
    exported again once, then found."""
    import json

    core = ensure_default_core(tmp_path, "float32")
    manifest = json.loads((core / "manifest.json").read_text())
    assert manifest["source"]["tensor_types"]["blk.0.attn_q.weight"][0] == "Q4_1"
    del manifest["source"]["tensor_types"]
    (core / "manifest.json").write_text(json.dumps(manifest))
    assert ensure_default_core(tmp_path, "float32") == core
    written = (core / "manifest.json").stat().st_mtime_ns
    assert "tensor_types" in read_manifest(core).source
    assert ensure_default_core(tmp_path, "float32") == core
    assert (core / "manifest.json").stat().st_mtime_ns == written  # (found, not exported again)
