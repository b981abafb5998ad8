"""A core that stores its layer matrices quantised (flarectl export --quantization) served on the GPU: the graphs take
the stored values back to bf16 (the values the CPU kernels compute with), and give the same greedy tokens as a plain
bf16 core holding those values. Skipped without a GPU (tests/cuda/conftest.py)."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch


def _plain_twin(stored_core, out):
    """A copy of ``stored_core`` whose stored matrices are written back as their bf16 values (a plain core)."""
    from safetensors.torch import load_file, save_file

    from flared.core.load import open_core
    from flared.model.loader import serving_tensor_shapes
    from flared.model.quant import PACKED_SUFFIXES, packed_format, packed_parts, packed_values

    shutil.copytree(stored_core, out)
    core = open_core(out)
    shapes = serving_tensor_shapes(core.config)
    manifest = json.loads((out / "manifest.json").read_text())
    for shard in core.manifest.weights:
        tensors = load_file(str(out / shard))
        for name in list(shapes):
            fmt = packed_format(tensors, name)
            if fmt is None:
                continue
            tensors[name] = packed_values(packed_parts(tensors, name, fmt), fmt, shapes[name][-2]).contiguous()
            for suffix in PACKED_SUFFIXES[fmt]:
                del tensors[f"{name}.{suffix}"]
        save_file(tensors, str(out / shard))
        data = (out / shard).read_bytes()
        manifest["assets"][shard] = {"sha256": hashlib.sha256(data).hexdigest(), "size_bytes": len(data)}
    manifest["weights_quantization"] = None
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_stored_core_serves_its_values_on_the_gpu(tiny_hf_llama, tmp_path, fmt):
    from flared.core.export import ExportOptions, export_core
    from flared.core.load import open_core
    from flared.model.quant import packed_parts, packed_values
    from flared.model.sampling import SamplingParams
    from flared.runtime.request import ErrorEvent, GenerateRequest, TokenEvent
    from flared.runtime.worker import ModelRuntime
    from flared_testing.runtime import run_requests

    stored = tmp_path / "stored"
    export_core(tiny_hf_llama, stored, ExportOptions(dtype="bfloat16", quantization=fmt, concurrency=4,
                                                     context_tokens=256, prefill_chunk_tokens=128))
    plain = _plain_twin(stored, tmp_path / "plain")
    prompts = [[5 + i, 17, 40 + 3 * i, 99, 7] * (2 + i) for i in range(4)]
    got = {}
    for which, core in (("stored", stored), ("plain", plain)):
        rt = ModelRuntime(open_core(core), prefix_cache=False)
        rt.start(max_pending=16)
        try:
            assert type(rt.executor).__name__ == "GraphExecutor"
            if which == "stored":
                tensors = open_core(stored).load_tensors()
                want = packed_values(packed_parts(tensors, "layers.1.gate_up.weight", fmt), fmt,
                                     rt.model.layers[1].gate_up.weight.shape[0])
                assert torch.equal(rt.model.layers[1].gate_up.weight.cpu(), want)
            requests = [GenerateRequest(tuple(p), (), SamplingParams(max_tokens=24, temperature=0.0), frozenset())
                        for p in prompts]
            tokens = []
            for events in run_requests(rt, requests):
                assert not isinstance(events[-1], ErrorEvent), events[-1]
                tokens.append([t for e in events if isinstance(e, TokenEvent) for t in e.token_ids])
            got[which] = tokens
        finally:
            rt.stop()
    assert got["stored"] == got["plain"]
    assert all(len(t) == 24 for t in got["stored"])
