"""Phi-3 / Phi-4 beyond the shared parity tests (test_parity_hf.py runs the phi3 and phi4_mini families' logits, greedy
tokens, embeddings and prompt logprobs against transformers): a GGUF as llama.cpp writes one (fused attn_qkv, ffn_up
holding gate and up, no q/k permutation, its sliding window, partial rotary, LongRoPE's tables), LongRoPE's long
factors (a served context past the original one), and what is refused."""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from flared.errors import CoreError, ErrorKind  # noqa: E402
from flared.model.config import from_hf_config  # noqa: E402
from flared.model.decoder import DecoderModel  # noqa: E402
from flared.model.loader import read_source  # noqa: E402

from .conftest import build_hf_checkpoint  # noqa: E402
from .test_gguf_families import write_gguf  # noqa: E402
from flared_testing.checkpoints import hf_last_logits, last_logits  # noqa: E402


def test_a_gguf_reads_as_its_checkpoint(tmp_path):
    hf_dir = build_hf_checkpoint("phi3", tmp_path / "hf")
    write_gguf(hf_dir, tmp_path / "m.gguf", "phi3", Q.F32)
    source = read_source(tmp_path / "m.gguf")
    assert source.config.sliding_window == read_source(hf_dir).config.sliding_window == 16
    # past the window, so the mask is exercised
    prompt = torch.randint(0, source.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


def _long_context_checkpoint(path, **rope):
    """A Phi-4-mini-like checkpoint whose original context (16) is far below its max_position_embeddings (512), so
    LongRoPE's attention factor follows from the two (sqrt(1 + ln 32 / ln 16)) as Phi-3.5's and Phi-4-mini's do."""
    hf_dir = build_hf_checkpoint("phi4_mini", path)
    config = json.loads((hf_dir / "config.json").read_text())
    config["original_max_position_embeddings"] = 16
    config["rope_parameters"].pop("attention_factor")
    config["rope_parameters"].update(original_max_position_embeddings=16, **rope)
    (hf_dir / "config.json").write_text(json.dumps(config))
    return hf_dir


@pytest.mark.parametrize("context, positions", [(16, 16), (512, 200)])
def test_longrope_tables_equal_transformers(tmp_path, context, positions):
    """Served contexts that fit the original one take the short factors, longer ones the long factors, as transformers
    takes them for a sequence of that length; cos and sin are scaled by the attention factor either way."""
    from flared.model.rope import rope_tables

    hf_dir = _long_context_checkpoint(tmp_path / "hf")
    config = read_source(hf_dir).config
    assert config.rotary_dim == 8 and config.rope_scaling["attention_factor"] == pytest.approx(
        (1 + math.log(32) / math.log(16)) ** 0.5)
    rotary = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).model.rotary_emb
    cos, sin = rotary(torch.zeros(1, positions, 8), torch.arange(positions)[None])
    ours = rope_tables(config, context, dtype=torch.float32, device="cpu")
    assert torch.equal(cos[0], ours[0][:positions]) and torch.equal(sin[0], ours[1][:positions])


def test_a_long_context_takes_the_long_factors(tmp_path):
    """A 60-token prompt (past the original 16) as transformers computes it (long factors for the whole sequence),
    through our paged forward with the served context at max_position_embeddings; a core served at the original
    context computes a short prompt with the short factors."""
    hf_dir = _long_context_checkpoint(tmp_path / "hf")
    source = read_source(hf_dir)
    prompt = torch.randint(0, source.config.vocab_size, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4
    short = last_logits(DecoderModel(source.config, source.tensors, max_positions=16), prompt[:14])
    assert (short - hf_last_logits(hf_dir, prompt[:14])).abs().max().item() < 1e-4


def test_a_phi4_mini_gguf_reads_as_its_checkpoint(tmp_path):
    """llama.cpp's Phi-4-mini: rope.dimension_count below the head, rope_factors_long / rope_factors_short tensors,
    the attention factor and original context as keys."""
    hf_dir = _long_context_checkpoint(tmp_path / "hf")
    write_gguf(hf_dir, tmp_path / "m.gguf", "phi3", Q.F32)
    source = read_source(tmp_path / "m.gguf")
    reference = read_source(hf_dir).config
    assert source.config.rotary_dim == reference.rotary_dim == 8
    assert source.config.rope_scaling["original_max_position_embeddings"] == 16
    assert source.config.rope_scaling["long_factor"] == pytest.approx(reference.rope_scaling["long_factor"])
    assert source.config.rope_scaling["attention_factor"] == pytest.approx(reference.rope_scaling["attention_factor"])
    prompt = torch.randint(0, source.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


def test_partial_rotary_is_not_in_the_graphs():
    """The CUDA graphs' kernels turn whole heads: a partially rotated core serves through the eager executor."""
    base = {"model_type": "phi3", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4}
    partial = from_hf_config({**base, "partial_rotary_factor": 0.75})
    assert partial.rotary_dim == 12 and partial.graph_obstacle == "partial rotary embeddings"
    whole = from_hf_config({**base, "partial_rotary_factor": 1.0})
    assert whole.rotary_dim is None and whole.graph_capable


@pytest.mark.parametrize("family, change, what", [
    # other families' transformers models ignore partial_rotary_factor: a checkpoint that sets it would be misread
    ("llama_tied", {"partial_rotary_factor": 0.5}, "partial rotary"),
    ("phi3", {"rope_scaling": {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}}, "dynamic"),
])
def test_what_we_cannot_compute_is_refused(tmp_path, family, change, what):
    hf_dir = build_hf_checkpoint(family, tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(change)
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CoreError, match=what) as info:
        read_source(hf_dir)
    assert info.value.kind == ErrorKind.UNSUPPORTED_MODEL


def test_longrope_tables_must_fit_the_rotated_dimensions(tmp_path):
    hf_dir = build_hf_checkpoint("phi4_mini", tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    config["rope_parameters"]["short_factor"] = [1.0] * 8  # (16 dimensions' worth: the head, not its rotated half)
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CoreError, match="one factor per rotated pair"):
        read_source(hf_dir)


def test_a_phi4_mini_core_serves_transformers_tokens(tmp_path):
    """Partial rotary and LongRoPE through export and `flared run` (a 256-token context, past the original 16: the long
    factors, as transformers takes them for the 40-token chat prompt): greedy chat tokens equal transformers'."""
    from flared_testing.served import assert_served_greedy_equals_transformers

    directory = _long_context_checkpoint(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert_served_greedy_equals_transformers(directory, hf, tmp_path)
