"""Phi-3 / Phi-4 beyond the shared parity tests (test_parity_hf.py runs the family's logits, greedy tokens,
embeddings and prompt logprobs against transformers): a GGUF as llama.cpp writes one (fused attn_qkv, ffn_up holding
gate and up, no q/k permutation, its sliding window), and what is refused (partial rotary, longrope)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from flared.errors import CoreError, ErrorKind  # noqa: E402
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


@pytest.mark.parametrize("change, what", [
    ({"partial_rotary_factor": 0.75}, "partial rotary"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}, "longrope"),
])
def test_what_we_cannot_compute_is_refused(tmp_path, change, what):
    hf_dir = build_hf_checkpoint("phi3", tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(change)
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CoreError, match=what) as info:
        read_source(hf_dir)
    assert info.value.kind == ErrorKind.UNSUPPORTED_MODEL
