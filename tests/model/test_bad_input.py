"""Bad sources and configs are clear CoreErrors naming the file or the field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from flared.errors import CoreError, ErrorKind
from flared.model.config import ModelConfig, from_hf_config
from flared.model.loader import load_serving_tensors, read_source, serving_tensor_shapes

from .conftest import build_hf_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_hf_checkpoint("llama3", tmp_path_factory.mktemp("llama3"))


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_truncated_gguf(smollm2_path, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as f:
        truncated.write_bytes(f.read(smollm2_path.stat().st_size // 3))
    with pytest.raises(CoreError) as info:
        read_source(truncated)
    assert str(truncated) in str(info.value)
    assert info.value.kind == ErrorKind.SOURCE_FORMAT


def test_gguf_header_only(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(CoreError, match="bogus.gguf"):
        read_source(bogus)


def test_corrupted_safetensors(llama_dir, tmp_path):
    bad = copy_checkpoint(llama_dir, tmp_path / "bad")
    weights = bad / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = b"#" * 32  # garble the JSON header
    weights.write_bytes(bytes(data))
    with pytest.raises(CoreError) as info:
        read_source(bad)
    assert "model.safetensors" in str(info.value)
    assert info.value.kind == ErrorKind.SOURCE_FORMAT


def test_truncated_safetensors(llama_dir, tmp_path):
    bad = copy_checkpoint(llama_dir, tmp_path / "short")
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(CoreError, match="model.safetensors"):
        read_source(bad)


def test_missing_tensor(llama_dir, tmp_path):
    from safetensors.torch import load_file

    bad = copy_checkpoint(llama_dir, tmp_path / "missing")
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(CoreError, match="model.layers.1.mlp.up_proj.weight"):
        read_source(bad)


@pytest.mark.parametrize("change, what", [
    ({"model_type": "xglm"}, "xglm"),
    # dynamic NTK turning inside the served context (its original shorter than max_position_embeddings)
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0,
                          "original_max_position_embeddings": 16}}, "dynamic"),
    ({"rope_parameters": {"rope_type": "factors", "factors": [2.0] * 8, "rope_theta": 10000.0}}, "factors"),
    ({"hidden_act": "gelu"}, "gelu"),
])
def test_unsupported_architecture(llama_dir, tmp_path, change, what):
    bad = copy_checkpoint(llama_dir, tmp_path / "unsupported")
    config = json.loads((bad / "config.json").read_text())
    config.update(change)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CoreError) as info:
        read_source(bad)
    assert info.value.kind == ErrorKind.UNSUPPORTED_MODEL
    assert what in str(info.value) and "config.json" in str(info.value)


def test_legacy_rope_scaling_key_is_read():
    config = from_hf_config({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                             "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
                             "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.rope_theta == 500000.0
    dynamic = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
               "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 4096,
               "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    # dynamic NTK turns only past the original context, which a core (max_position_embeddings at most) never reaches
    assert from_hf_config(dynamic).rope_scaling is None
    with pytest.raises(CoreError, match="dynamic"):
        from_hf_config({**dynamic, "rope_scaling": {"type": "dynamic", "factor": 2.0,
                                                    "original_max_position_embeddings": 2048}})


def test_missing_source(tmp_path):
    with pytest.raises(CoreError) as info:
        read_source(tmp_path / "nothing-here")
    assert info.value.kind == ErrorKind.CORE_MISSING


def test_model_config_dict_round_trip_is_strict(llama_dir):
    config = read_source(llama_dir).config
    d = json.loads(json.dumps(config.to_dict()))
    assert ModelConfig.from_dict(d) == config
    with pytest.raises(CoreError, match="unknown keys: surprise"):
        ModelConfig.from_dict({**d, "surprise": 1})
    del d["head_dim"]
    with pytest.raises(CoreError, match="missing keys: head_dim"):
        ModelConfig.from_dict(d)
    with pytest.raises(CoreError, match="num_heads"):
        ModelConfig.from_dict({**config.to_dict(), "num_heads": 3})
    with pytest.raises(CoreError) as info:
        ModelConfig.from_dict({**config.to_dict(), "architecture": "falcon"})
    assert info.value.kind == ErrorKind.UNSUPPORTED_MODEL


def test_serving_file_round_trip_and_checks(llama_dir, tmp_path):
    source = read_source(llama_dir)
    path = tmp_path / "weights.safetensors"
    save_file(source.tensors, path)
    loaded = load_serving_tensors(path, source.config)
    assert loaded.keys() == serving_tensor_shapes(source.config).keys()
    for name, tensor in source.tensors.items():
        assert torch.equal(loaded[name], tensor)
    wrong = dict(source.tensors)
    wrong["layers.0.qkv.weight"] = wrong["layers.0.qkv.weight"][:-1].contiguous()
    save_file(wrong, tmp_path / "wrong.safetensors")
    with pytest.raises(CoreError, match=r"wrong.safetensors.*layers.0.qkv.weight"):
        load_serving_tensors(tmp_path / "wrong.safetensors", source.config)
    with pytest.raises(CoreError, match="absent.safetensors"):
        load_serving_tensors(tmp_path / "absent.safetensors", source.config)
