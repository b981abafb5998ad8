"""ByteDance Seed-OSS beyond the shared parity tests (test_parity_hf.py runs the seed_oss family against transformers):
a GGUF as llama.cpp writes one (its seed_oss architecture: q/k/v biases, no o bias, no q/k permutation) reads to the
checkpoint's logits. (Its <seed:think> reasoning and <seed:tool_call> calls: tests/api/test_parsers.py.)"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from flared.model.decoder import DecoderModel  # noqa: E402
from flared.model.loader import read_source  # noqa: E402

from .conftest import build_hf_checkpoint  # noqa: E402
from .test_gguf_families import write_gguf  # noqa: E402
from flared_testing.checkpoints import hf_last_logits, last_logits  # noqa: E402


def test_a_gguf_reads_as_its_checkpoint(tmp_path):
    hf_dir = build_hf_checkpoint("seed_oss", tmp_path / "hf")
    write_gguf(hf_dir, tmp_path / "m.gguf", "seed_oss", Q.F32)
    source = read_source(tmp_path / "m.gguf")
    config = read_source(hf_dir).config
    assert (config.attention_bias, config.attention_out_bias, config.head_dim) == (True, False, 32)
    for field in ("architecture", "attention_bias", "attention_out_bias", "head_dim", "num_heads", "num_kv_heads",
                  "tie_word_embeddings", "rope_theta", "rope_scaling"):
        assert getattr(source.config, field) == getattr(config, field), field
    prompt = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4
