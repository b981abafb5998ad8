"""A core that stores its layer matrices quantised (flarectl export --quantization) served on the GPU: as it is, the
fused kernels over the stored values widened to bf16 (the values the CPU kernels compute with); with -q in its
format, the stored blocks kept (kernels/wquant.py's products over quant.gpu_layout's copy of them), giving the greedy
tokens of the plain bf16 core quantised at load in that format (the same quantiser, so the same blocks, bit for
bit). Skipped without a GPU (tests/cuda/conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_stored_core_on_the_gpu_serves_its_values_or_keeps_its_blocks(tiny_hf_llama, tmp_path, fmt):
    from flared.core.export import ExportOptions, export_core
    from flared.core.load import open_core
    from flared.model.quant import gpu_values, packed_parts, packed_values
    from flared.model.sampling import SamplingParams
    from flared.runtime.request import ErrorEvent, GenerateRequest, TokenEvent
    from flared.runtime.worker import ModelRuntime
    from flared_testing.runtime import run_requests

    options = dict(dtype="bfloat16", concurrency=4, context_tokens=256, prefill_chunk_tokens=128)
    stored, plain = tmp_path / "stored", tmp_path / "plain"
    export_core(tiny_hf_llama, stored, ExportOptions(quantization=fmt, **options))
    export_core(tiny_hf_llama, plain, ExportOptions(**options))
    prompts = [[5 + i, 17, 40 + 3 * i, 99, 7] * (2 + i) for i in range(4)]
    got = {}
    for which, core, quantization in (("values", stored, None), ("stored", stored, fmt), ("plain", plain, fmt)):
        rt = ModelRuntime(open_core(core), prefix_cache=False, quantization=quantization)
        rt.start(max_pending=16)
        try:
            assert type(rt.executor).__name__ == "GraphExecutor"
            lin = rt.model.layers[1].gate_up
            assert rt.executor.decoder.generic == (quantization is not None)
            want = packed_values(packed_parts(open_core(stored).load_tensors(), "layers.1.gate_up.weight", fmt), fmt,
                                 lin.out_features)
            if which == "values":
                assert lin.quant is None and torch.equal(lin.weight.cpu(), want)
            else:
                values = gpu_values(lin.quant_tensors, fmt, in_features=lin.in_features)
                assert lin.on_gpu and lin.quant_kind == fmt and torch.equal(values.cpu(), want)
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
    assert all(len(t) == 24 for tokens in got.values() for t in tokens)
