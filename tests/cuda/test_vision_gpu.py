"""A vision core on a GPU machine: the CUDA graphs take token ids only, so it serves text there and answers image
parts with a 400 that says why (docs/gpu.md, "Not yet"). Skipped without a GPU (tests/cuda/conftest.py)."""

from __future__ import annotations

import base64
import io

import numpy as np


def test_a_vision_core_serves_text_and_refuses_images_on_the_gpu(tiny_hf_smolvlm, tmp_path, start_daemon):
    from PIL import Image

    from flared.core.export import ExportOptions, export_core

    core = tmp_path / "core"  # bf16: the dtype the CUDA backend serves
    export_core(tiny_hf_smolvlm, core, ExportOptions(dtype="bfloat16", concurrency=4, context_tokens=512,
                                                     prefill_chunk_tokens=128))
    d = start_daemon(core)
    status, body = d.chat([{"role": "user", "content": "Hello there."}], max_tokens=4)
    assert status == 200, body
    buf = io.BytesIO()
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    status, body = d.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                         {"type": "text", "text": "What?"}]}], max_tokens=4)
    assert status == 400 and "CUDA graphs" in body["error"]["message"], body
    status, body = d.request("GET", "/v1/models")
    assert body["data"][0]["capabilities"]["vision"] is False


def test_with_enforce_eager_a_vision_core_takes_images_on_the_gpu(tiny_hf_smolvlm, tmp_path, start_daemon):
    """--enforce-eager: the eager executor on the GPU runs the tower and places the image rows."""
    from PIL import Image

    from flared.core.export import ExportOptions, export_core

    core = tmp_path / "core"
    export_core(tiny_hf_smolvlm, core, ExportOptions(dtype="bfloat16", concurrency=4, context_tokens=512,
                                                     prefill_chunk_tokens=128))
    d = start_daemon(core, "--enforce-eager")
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 30, 3), dtype=np.uint8)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    status, body = d.chat([{"role": "user", "content": "What?"}], max_tokens=4)
    assert status == 200, body
    text_tokens = body["usage"]["prompt_tokens"]
    status, body = d.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                         {"type": "text", "text": "What?"}]}], max_tokens=4)
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] > text_tokens + 4  # the image's tokens
    assert "enforce_eager" in d.log() and "executor: eager on" in d.log()
    status, body = d.request("GET", "/v1/models")
    assert body["data"][0]["capabilities"]["vision"] is True
