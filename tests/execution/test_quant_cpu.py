"""--quantization q8_0 / q4_1 on the CPU model thread: a bfloat16 core served with its products kept quantised
(flared/model/quant.py). The greedy tokens start as the bf16 core's do, a prompt served again over its cached prefix
gives the cold run's tokens, and where the weights cannot be kept so (a float32 core) the runtime refuses at start
with the reason."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
linear = pytest.importorskip("flared._fast.linear")


def _serve(core, quantization, prompts, repeat_first=False):
    from flared.core.load import open_core
    from flared.model.sampling import SamplingParams
    from flared.runtime.request import ErrorEvent, FinishEvent, GenerateRequest, TokenEvent
    from flared.runtime.worker import ModelRuntime
    from flared_testing.runtime import run_requests

    rt = ModelRuntime(open_core(core), prefix_cache=True, quantization=quantization)
    rt.start(max_pending=16)
    try:
        tokens, cached = [], []
        for batch in [prompts] + ([prompts[:1]] if repeat_first else []):
            reqs = [GenerateRequest(tuple(p), (), SamplingParams(max_tokens=12, temperature=0.0), frozenset())
                    for p in batch]
            for events in run_requests(rt, reqs):
                assert isinstance(events[-1], FinishEvent), events[-1]
                assert not isinstance(events[-1], ErrorEvent)
                cached.append(events[-1].num_cached_tokens)
                tokens.append([t for e in events if isinstance(e, TokenEvent) for t in e.token_ids])
        return tokens, cached, rt.model
    finally:
        rt.stop()


@pytest.mark.skipif(not linear.BF16_SUPPORTED, reason="this CPU has neither AVX-512 BF16 nor AVX2")
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_the_cpu_model_thread_serves_quantised_weights(bf16_core, fmt):
    prompts = [[5 + i, 17, 40 + 3 * i, 9, 7] * (7 + i) for i in range(4)]
    base, _, _ = _serve(bf16_core, None, prompts)
    got, cached, model = _serve(bf16_core, fmt, prompts, repeat_first=True)
    assert all(lin.quant_kind == fmt for layer in model.layers for lin in model._linears(layer))
    assert model.lm_head_linear.quant_kind == "q8_0"  # (a Q4_1 model's head too: quant.HEAD_QUANTIZATION)
    assert all(len(t) == 12 for t in got)
    assert cached[-1] >= 32 and got[-1] == got[0]  # (the warm run over the cached prefix: the cold run's tokens)
    firsts = sum(a[0] == b[0] for a, b in zip(got[:4], base))
    assert firsts >= 3, (firsts, got[:4], base)


def test_a_float32_core_is_refused_with_the_reason(tiny_core):
    from flared.core.load import open_core
    from flared.errors import ExecutionError
    from flared.runtime.worker import ModelRuntime

    rt = ModelRuntime(open_core(tiny_core), quantization="q8_0")
    with pytest.raises(ExecutionError, match="--quantization q8_0 runs over a bfloat16 core; this core is float32"):
        rt.start(max_pending=4)


@pytest.mark.skipif(not linear.BF16_SUPPORTED, reason="this CPU has neither AVX-512 BF16 nor AVX2")
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_flared_run_serves_quantised_and_flarectl_lists_it(bf16_core, tmp_path, fmt):
    """`flared run -q q8_0` (or q4_1): /v1/completions answers; `flarectl models` names the quantization and its
    bytes, and Ollama's /api/show its level, "Q8_0" ("Q4_1")."""
    from flared_testing.daemon import Daemon

    daemon = Daemon(bf16_core, tmp_path, "-q", fmt, admin_socket=True)
    try:
        status, out = daemon.request("POST", "/v1/completions", {"model": "tiny", "prompt": list(range(3, 30)),
                                                                 "max_tokens": 8, "temperature": 0})
        assert status == 200, out
        assert out["usage"]["completion_tokens"] == 8
        assert f"products kept as {fmt}" in daemon.log()
        listed = daemon.ctl("models").stdout
        assert f"weights:     {fmt} (" in listed and " MiB" in listed, listed
        status, shown = daemon.request("POST", "/api/show", {"model": "tiny"})  # (Ollama's)
        assert status == 200 and shown["details"]["quantization_level"] == fmt.upper(), shown
        status, metrics = daemon.request("GET", "/metrics")  # (Prometheus text: the raw bytes)
        assert status == 200 and f'flare_weight_bytes{{quantization="{fmt}"}}'.encode() in metrics, metrics[:2000]
    finally:
        daemon.kill()


@pytest.mark.skipif(not linear.BF16_SUPPORTED, reason="this CPU has neither AVX-512 BF16 nor AVX2")
def test_run_batch_takes_the_flag(bf16_core, tmp_path):
    """`flared run-batch -q q8_0`: the offline lines run over the quantised weights (its log says so)."""
    import json
    import subprocess
    import sys

    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": list(range(3, 30)), "max_tokens": 6, "temperature": 0}}
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps(line) + "\n")
    cmd = [sys.executable, "-m", "flared.cli.daemon", "run-batch", "-i", str(src), "-o", str(out), "--served-name",
           "tiny", "-q", "q8_0", "--log-level", "info", str(bf16_core)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "products kept as q8_0" in done.stderr
    row = json.loads(out.read_text())
    assert row["response"]["status_code"] == 200 and row["response"]["body"]["usage"]["completion_tokens"] == 6


@pytest.mark.skipif(not linear.BF16_SUPPORTED, reason="this CPU has neither AVX-512 BF16 nor AVX2")
def test_flarectl_generate_takes_the_flag(bf16_core, tiny_core):
    """`flarectl generate CORE -q q8_0`: a one-shot generation over the quantised weights; a float32 core is refused
    with the reason (exit 1)."""
    import json

    from click.testing import CliRunner

    from flared.cli.ctl import main as flarectl

    for fmt in ("q8_0", "q4_1"):
        done = CliRunner().invoke(flarectl, ["generate", str(bf16_core), "--prompt", "hello there", "--max-tokens",
                                             "5", "-q", fmt, "--json"])
        assert done.exit_code == 0, done.output
        assert len(json.loads(done.output)["token_ids"]) == 5
    refused = CliRunner().invoke(flarectl, ["generate", str(tiny_core), "--prompt", "hello", "-q", "q8_0"])
    assert refused.exit_code == 1 and "q8_0 weights run in bfloat16, on a GPU or on the CPU executor" in refused.output
