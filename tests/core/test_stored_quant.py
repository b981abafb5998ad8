"""Cores that store their layer matrices quantised (flarectl export --quantization): the kernels' tensors on disk in
place of the bf16 matrices, read as they are (the same logits and tokens as quantising a plain core at load), their
values taken back where a model keeps them otherwise (float32, another format, a GPU), and a GGUF or quantised
checkpoint served directly on the CPU cached so."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from flared.core.export import ExportOptions, export_core
from flared.core.load import open_core
from flared.core.manifest import read_manifest
from flared.errors import CoreError, ErrorKind
from flared.model.decoder import DecoderModel
from flared.model.quant import (PACKED_MATRIX, QuantPlan, pack_layer_matrices, packed_format, packed_parts,
                                packed_values)

from flared_testing.checkpoints import build_hf_checkpoint, last_logits

try:
    from flared._fast.linear import BF16_SUPPORTED
except ImportError:  # (a build without the CPU kernels)
    BF16_SUPPORTED = False
needs_kernels = pytest.mark.skipif(not BF16_SUPPORTED, reason="this CPU lacks the bf16 kernels quantised weights run on")
PROMPT = list(range(3, 40))


def _bf16(source):
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in source.tensors.items()}


@needs_kernels
@pytest.mark.parametrize("family", ["qwen3", "qwen2_moe"])
def test_stored_matrices_give_the_logits_of_quantising_at_load(family, tmp_path):
    """A plan's matrices stored (a mixture's expert stacks too) and read as they are: bit-equal logits to the same
    plan quantising the bf16 tensors at load; in float32 the stored values, taken back, give their own logits."""
    from flared.model.loader import read_source

    source = read_source(build_hf_checkpoint(family, tmp_path), dtype=torch.bfloat16)
    tensors = _bf16(source)
    down = "layers.1.experts.down.weight" if family == "qwen2_moe" else "layers.1.down.weight"
    plan = QuantPlan("q4_1", {down: "q8_0", "layers.0.o.weight": None})
    stored = pack_layer_matrices(tensors, plan)
    assert down not in stored and packed_format(stored, down) == "q8_0"
    assert "layers.0.o.weight" in stored  # (kept bf16 by the plan)
    at_load = last_logits(DecoderModel(source.config, tensors, dtype=torch.bfloat16, quantization=plan), PROMPT)
    as_stored = last_logits(DecoderModel(source.config, stored, dtype=torch.bfloat16, quantization=plan), PROMPT)
    assert torch.equal(at_load, as_stored)
    values = {}
    for name, value in tensors.items():
        fmt = packed_format(stored, name) if PACKED_MATRIX.match(name) else None
        values[name] = value.float() if fmt is None else packed_values(packed_parts(stored, name, fmt), fmt,
                                                                        value.shape[-2], torch.float32)
    wide = last_logits(DecoderModel(source.config, stored, dtype=torch.float32), PROMPT)
    assert torch.equal(wide, last_logits(DecoderModel(source.config, values, dtype=torch.float32), PROMPT))
    # (another format than the stored one: the values quantised again, as from a plain core of them)
    other = DecoderModel(source.config, stored, dtype=torch.bfloat16, quantization="q8_0")
    assert other.layers[0].qkv.quant_kind == "q8_0"


@needs_kernels
def test_an_exported_core_stores_them_and_serves_the_same_tokens(default_gguf, tmp_path):
    from flared.runtime.oneshot import OneShot

    plain = export_core(default_gguf, tmp_path / "plain", ExportOptions(dtype="bfloat16"))
    stored = export_core(default_gguf, tmp_path / "stored", ExportOptions(dtype="bfloat16", quantization="q4_1"))
    # (the embedded GGUF's tensors are 4-bit: its plan searches their grids)
    assert stored.weights_quantization == {"default": "q4_1", "matrices": {}, "grids": True}
    assert plain.weights_quantization is None
    plain_bytes, stored_bytes = (sum(a.size_bytes for n, a in m.assets.items() if n in m.weights)
                                 for m in (plain, stored))
    assert stored_bytes < 0.5 * plain_bytes
    assert read_manifest(tmp_path / "stored").weights_quantization == stored.weights_quantization
    prompt = "The capital of France is"
    a = OneShot.open(tmp_path / "plain", quantization="q4_1").generate(prompt=prompt, max_tokens=8)
    b = OneShot.open(tmp_path / "stored").generate(prompt=prompt, max_tokens=8)
    assert a["text"] == b["text"] and b["usage"]["completion_tokens"] == 8
    tensors = open_core(tmp_path / "stored").load_tensors()
    assert tensors["layers.3.gate_up.weight.q4_1"].dtype == torch.uint8


def test_a_stored_core_is_checked(tmp_path):
    """A stored matrix's tensors at the wrong shape, and a malformed manifest field, are named; the option needs
    a bfloat16 core."""
    from safetensors.torch import load_file, save_file

    with pytest.raises(CoreError, match="over bfloat16"):
        ExportOptions(dtype="float32", quantization="q4_1")
    source = build_hf_checkpoint("qwen3", tmp_path / "hf")
    from flared_testing.served import write_char_tokenizer

    write_char_tokenizer(source, 512)
    export_core(source, tmp_path / "core", ExportOptions(dtype="bfloat16", quantization="q8_0", concurrency=2,
                                                         context_tokens=128, prefill_chunk_tokens=64))
    core = open_core(tmp_path / "core")
    assert core.manifest.weights_quantization["default"] == "q8_0"
    shard = tmp_path / "core" / core.manifest.weights[0]
    tensors = load_file(shard)
    tensors["layers.0.qkv.weight.q8_0_scales"] = tensors["layers.0.qkv.weight.q8_0_scales"][:, :1].contiguous()
    save_file(tensors, shard)
    with pytest.raises(CoreError, match="layers.0.qkv.weight stored as q8_0 needs layers.0.qkv.weight.q8_0_scales"):
        core.load_tensors()
    manifest = json.loads((tmp_path / "core" / "manifest.json").read_text())
    manifest["weights_quantization"] = {"default": "q5_0"}
    (tmp_path / "core" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CoreError, match="weights_quantization") as info:
        read_manifest(tmp_path / "core")
    assert info.value.kind == ErrorKind.CORE_FORMAT


@needs_kernels
def test_a_gguf_served_directly_caches_a_stored_core(default_gguf, tmp_path):
    """`flarectl generate model.gguf` on a CPU: the cached core stores the matrices as -q gguf keeps them."""
    from flared.core.sources import kept_quantization

    if kept_quantization(default_gguf)[0] is None:
        pytest.skip("this machine keeps no GGUF's bits (a GPU, or a CPU without the quantised kernels)")
    run = [sys.executable, "-m", "flared.cli.ctl", "generate", str(default_gguf), "--cache-dir", str(tmp_path),
           "--prompt", "The capital of France is", "--max-tokens", "4", "--json"]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    cores = sorted((tmp_path / "sources").glob("*-bfloat16-gguf"))
    assert len(cores) == 1, list((tmp_path / "sources").iterdir())
    assert read_manifest(cores[0]).weights_quantization["default"] == "q4_1"


@needs_kernels
@pytest.mark.parametrize("family", ["deepseek_v2", "gpt_oss", "lfm2", "granite4_h", "llama4", "phi"])
def test_other_families_read_their_stored_matrices(family, tmp_path):
    """Latent attention, sinks and biased experts, short convolutions, Mamba-2 hybrids, chunked attention, a
    parallel block: every layer matrix a plan stores reads back to the logits of quantising at load."""
    from flared.model.loader import read_source

    source = read_source(build_hf_checkpoint(family, tmp_path), dtype=torch.bfloat16)
    tensors = _bf16(source)
    stored = pack_layer_matrices(tensors, QuantPlan("q4_1"))
    assert any(k.endswith(".q4_1") for k in stored)
    at_load = last_logits(DecoderModel(source.config, tensors, dtype=torch.bfloat16, quantization="q4_1"), PROMPT)
    as_stored = last_logits(DecoderModel(source.config, stored, dtype=torch.bfloat16,
                                         quantization=QuantPlan("q4_1")), PROMPT)
    assert torch.equal(at_load, as_stored)
