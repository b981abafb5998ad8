"""Serving a GGUF file or a Hugging Face checkpoint directly (flared/core/sources.py): `flared run model.gguf`
exports it once into the cache and reuses that core until the source changes."""

from __future__ import annotations

import os
import shutil

import pytest

from flared.core.manifest import read_manifest
from flared.core.sources import ensure_source_core, source_kind


def test_what_counts_as_a_source(tiny_hf_llama, tiny_core, default_gguf, tmp_path):
    assert source_kind(default_gguf) == "gguf"
    assert source_kind(tiny_hf_llama) == "hf"
    assert source_kind(tiny_core) is None  # (a core is served as it is)
    (tmp_path / "weights.gguf").write_bytes(b"not a GGUF at all")
    assert source_kind(tmp_path / "weights.gguf") is None  # (by its magic, not its name)
    assert source_kind(tmp_path / "missing.gguf") is None
    assert source_kind(tmp_path) is None  # (a directory without config.json)


def test_a_gguf_is_exported_once_then_reused(default_gguf, tmp_path):
    core = ensure_source_core(default_gguf, tmp_path, "float32")
    manifest = read_manifest(core)
    assert manifest.dtype == "float32" and manifest.source["kind"] == "gguf"
    assert manifest.served_names == ("smollm2-135m-instruct.q4-1",)
    written = (core / "manifest.json").stat().st_mtime_ns
    assert ensure_source_core(default_gguf, tmp_path, "float32") == core
    assert (core / "manifest.json").stat().st_mtime_ns == written  # found, not exported again


def test_a_changed_checkpoint_is_exported_again_over_its_core(tiny_hf_llama, tmp_path):
    source = tmp_path / "my-llama"
    shutil.copytree(tiny_hf_llama, source)
    cache = tmp_path / "cache"
    core = ensure_source_core(source, cache, "bfloat16")
    assert read_manifest(core).dtype == "bfloat16" and read_manifest(core).served_names == ("my-llama",)
    written = (core / "manifest.json").stat().st_mtime_ns
    # another dtype is another core beside it
    other = ensure_source_core(source, cache, "float32")
    assert other != core and read_manifest(other).dtype == "float32"
    # a weight file replaced (its time moved on): the same core, written again
    weights = next(source.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert ensure_source_core(source, cache, "bfloat16") == core
    assert (core / "manifest.json").stat().st_mtime_ns != written
    assert sorted(p.name for p in (cache / "sources").iterdir() if not p.name.startswith(".")) == sorted(
        [core.name, core.name + ".source.json", other.name, other.name + ".source.json"])


def test_flared_run_serves_a_checkpoint_directly(tiny_hf_llama, start_daemon, tmp_path):
    cache = tmp_path / "cache"
    daemon = start_daemon(tiny_hf_llama, "--cache-dir", str(cache), "--dtype", "float32")
    assert "exporting" in daemon.log()
    status, models = daemon.request("GET", "/v1/models")
    assert status == 200
    [model] = models["data"]
    # export's name for it, the path as given (vLLM's and llama.cpp's server's name for it), and --served-name's
    assert {model["id"], *model["aliases"]} == {tiny_hf_llama.name, str(tiny_hf_llama), "tiny"}
    status, body = daemon.request("POST", "/v1/chat/completions", {
        "model": str(tiny_hf_llama), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert status == 200, body
    assert body["model"] == str(tiny_hf_llama) and body["usage"]["completion_tokens"] >= 1
    daemon.stop()
    # a second daemon finds the core in the cache
    again = start_daemon(tiny_hf_llama, "--cache-dir", str(cache), "--dtype", "float32")
    assert "exporting" not in again.log()
    assert again.request("GET", "/v1/models")[0] == 200


def test_gguf_quantization_follows_the_files_layer_matrices(default_gguf):
    from flared.core.sources import gguf_quantization

    assert gguf_quantization(default_gguf) == ("q4_1", "Q4_1 100%")


def test_a_gguf_served_directly_on_the_cpu_keeps_its_bits(default_gguf, start_daemon, tmp_path):
    """As llama.cpp's server keeps a Q4_1 file's weights at 4 bits, `flared run model.Q4_1.gguf` on a CPU serves them
    as q4_1 (the file's blocks, found again); -q none keeps bfloat16."""
    from flared._fast.linear import BF16_SUPPORTED
    from flared.runtime.worker import cuda_backend_available

    import torch

    if not BF16_SUPPORTED or cuda_backend_available(torch.bfloat16):
        pytest.skip("quantised weights serve on a CPU with the bf16 kernels")
    cache = ["--cache-dir", str(tmp_path / "cache"), "--dtype", "bfloat16"]
    daemon = start_daemon(default_gguf, *cache)
    assert "each served at about its bits on the CPU (-q gguf" in daemon.log()
    assert "-bfloat16-gguf (once)" in daemon.log()  # (its cached core stores them so: tests/core/test_stored_quant.py)
    status, shown = daemon.request("POST", "/api/show", {"model": str(default_gguf)})
    assert status == 200 and shown["details"]["quantization_level"] == "Q4_1"
    status, body = daemon.request("POST", "/v1/completions", {"model": "tiny", "prompt": "The capital of France is",
                                                              "max_tokens": 4, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    daemon.stop()
    plain = start_daemon(default_gguf, *cache, "-q", "none")
    assert "about its bits" not in plain.log()
    status, shown = plain.request("POST", "/api/show", {"model": "tiny"})
    assert status == 200 and shown["details"]["quantization_level"] == "BF16"


def test_capacities_asked_for_make_a_core_of_their_own(tiny_hf_llama, tiny_core, start_daemon, tmp_path):
    """`flared run SOURCE --max-model-len N --max-num-seqs M --max-num-batched-tokens P` (vLLM's names; --context,
    --concurrency, --prefill-chunk) exports the source with those capacities, a core of their own beside the
    defaults'; a core's were fixed at export."""
    import subprocess
    import sys

    from flared.core.manifest import read_manifest
    from flared.core.sources import source_core_dir

    cache = tmp_path / "cache"
    daemon = start_daemon(tiny_hf_llama, "--cache-dir", str(cache), "--dtype", "float32", "--max-model-len", "128",
                          "--max-num-seqs", "2", "--max-num-batched-tokens", "64")
    [model] = daemon.request("GET", "/v1/models")[1]["data"]
    assert model["max_model_len"] == 128
    core = source_core_dir(tiny_hf_llama, cache, "float32", {"context": 128, "concurrency": 2, "prefill_chunk": 64})
    caps = read_manifest(core).capacities
    assert (caps.context_tokens, caps.concurrency, caps.prefill_chunk_tokens) == (128, 2, 64)
    status, body = daemon.request("POST", "/v1/completions", {"model": "tiny", "prompt": "hi " * 200, "max_tokens": 2})
    assert status == 400, body  # (past the 128-token context)
    proc = subprocess.run([sys.executable, "-m", "flared.cli.daemon", "run", str(tiny_core), "--context", "64",
                           "--port", "0", "--no-admin-socket", "--no-dashboard"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "its capacities were fixed when it was exported" in proc.stderr


def test_flarectl_generate_runs_a_gguf_at_its_bits_on_the_cpu(default_gguf, tmp_path):
    import json
    import subprocess
    import sys

    from flared.core.sources import kept_quantization

    fmt, _ = kept_quantization(default_gguf)
    if fmt is None:
        pytest.skip("this machine keeps no GGUF's bits (a GPU, or a CPU without the quantised kernels)")
    run = [sys.executable, "-m", "flared.cli.ctl", "generate", str(default_gguf), "--cache-dir", str(tmp_path),
           "--prompt", "The capital of France is", "--max-tokens", "4", "--json"]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "each run at about its bits" in proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["usage"]["completion_tokens"] == 4
    plain = subprocess.run(run + ["-q", "none"], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and "about its bits" not in plain.stderr


def test_flarectl_generate_takes_the_capacities_too(tiny_hf_llama, tiny_core, tmp_path):
    """`flarectl generate SOURCE --max-model-len N` runs the source's core of that context (a core of its own in the
    cache, as `flared run` makes it); given with a core, the flags stop it with the reason."""
    import json
    import subprocess
    import sys

    from flared.core.sources import source_core_dir

    cache = tmp_path / "cache"
    run = [sys.executable, "-m", "flared.cli.ctl", "generate", str(tiny_hf_llama), "--cache-dir", str(cache),
           "--prompt", "hello", "--max-tokens", "3", "--json", "--max-model-len", "96", "--kv-cache-mib", "8"]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["usage"]["completion_tokens"] >= 1
    core = source_core_dir(tiny_hf_llama, cache, "float32", {"context": 96, "kv_cache_mib": 8})
    assert read_manifest(core).capacities.context_tokens == 96
    proc = subprocess.run([sys.executable, "-m", "flared.cli.ctl", "generate", str(tiny_core), "--prompt", "hi",
                           "--context", "64"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "its capacities were fixed when it was exported" in proc.stderr
