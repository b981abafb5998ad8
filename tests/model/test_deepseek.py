"""DeepSeek V2 / V3 beyond the shared parity tests (test_parity_hf.py runs both families: latent attention, YaRN with
DeepSeek's mscales, V2's scaled softmax routing and V3's grouped sigmoid routing, shared experts, a dense first layer):
a served core's greedy tokens, and what is refused."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flared.errors import CoreError, ErrorKind  # noqa: E402
from flared.model.loader import read_source  # noqa: E402

from .conftest import build_hf_checkpoint  # noqa: E402


def test_a_deepseek_core_serves_transformers_tokens(tmp_path):
    """Exported (the router kept float32) and served by flared run: greedy chat tokens equal transformers'."""
    from flared_testing.served import assert_served_greedy_equals_transformers

    directory = build_hf_checkpoint("deepseek_v3", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert_served_greedy_equals_transformers(directory, hf, tmp_path)


def test_the_cache_holds_a_key_and_value_per_head(tmp_path):
    """Latent attention is served expanded: a key/value head per query head, head_dim = nope + rope wide (the values
    padded to it), the rotated part first."""
    config = read_source(build_hf_checkpoint("deepseek_v2", tmp_path / "hf")).config
    assert (config.num_kv_heads, config.head_dim, config.rotary_dim, config.v_head_dim) == (4, 24, 8, 12)
    assert config.graph_obstacle == "multi-head latent attention" and config.router_float32


def test_what_latent_attention_models_refuse(tmp_path):
    from flared.model.lora import LoraAdapter, merge_adapters

    from .test_lora import write_adapter

    hf_dir = build_hf_checkpoint("deepseek_v2", tmp_path / "hf")
    source = read_source(hf_dir)
    write_adapter(tmp_path / "adapter", {"model.layers.0.self_attn.kv_b_proj": (32, 4 * 28, False)})
    with pytest.raises(CoreError, match="latent attention") as info:
        merge_adapters(dict(source.tensors), source.config, [LoraAdapter(tmp_path / "adapter", 1.0)])
    assert info.value.kind == ErrorKind.UNSUPPORTED_MODEL
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "topk_method": "group_limited_greedy", "n_group": 2,
                                                    "topk_group": 1}))
    with pytest.raises(CoreError, match="group_limited_greedy") as info:
        read_source(hf_dir)
    assert info.value.kind == ErrorKind.UNSUPPORTED_MODEL
