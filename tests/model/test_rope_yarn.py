"""YaRN rope: the tables equal transformers' rotary embedding (cos and sin scaled by the attention factor) for
the parameter sets real checkpoints use, and a GGUF that llama.cpp's converter marks yarn reads to the same
parameters as its checkpoint. (test_parity_hf.py runs the qwen3_yarn family's logits and tokens.)"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flared.errors import CoreError, ErrorKind  # noqa: E402
from flared.model.config import from_hf_config  # noqa: E402
from flared.model.rope import rope_tables  # noqa: E402

from .conftest import build_hf_checkpoint  # noqa: E402
from .test_gguf_families import write_gguf  # noqa: E402


@pytest.mark.parametrize("scaling", [
    {"factor": 4.0, "original_max_position_embeddings": 128},  # Qwen3's documented setting, scaled down
    {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "mscale": 0.707, "mscale_all_dim": 0.707},
    {"factor": 3.0, "original_max_position_embeddings": 100, "truncate": False, "attention_factor": 1.3},
    {"factor": 2.0},  # the original context defaults to max_position_embeddings
])
def test_tables_equal_transformers(scaling):
    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rope_scaling={"rope_type": "yarn", "rope_theta": 10000.0, **scaling})
    rotary = transformers.Qwen3Model(config).rotary_emb
    cos, sin = rotary(torch.zeros(1, 600, 64), torch.arange(600)[None])
    ours = from_hf_config(config.to_dict())
    assert ours.rope_scaling["rope_type"] == "yarn"
    our_cos, our_sin = rope_tables(ours, 600, dtype=torch.float32, device="cpu")
    assert torch.equal(cos[0], our_cos) and torch.equal(sin[0], our_sin)
    assert ours.rope_scaling["attention_factor"] == pytest.approx(rotary.attention_scaling)


def _write_yarn_gguf(tmp_path, extra: dict):
    import gguf

    hf_dir = build_hf_checkpoint("qwen3_yarn", tmp_path / "hf")
    path = tmp_path / "yarn.gguf"
    real_writer = gguf.GGUFWriter

    class Writer(real_writer):  # write_gguf's keys, and llama.cpp's rope scaling keys beside them
        def write_header_to_file(self, *args, **kwargs):
            self.add_string("qwen3.rope.scaling.type", "yarn")
            self.add_float32("qwen3.rope.scaling.factor", 8.0)
            self.add_uint32("qwen3.rope.scaling.original_context_length", 64)
            for key, value in extra.items():
                self.add_float32(f"qwen3.rope.scaling.{key}", value)
            return super().write_header_to_file(*args, **kwargs)

    gguf.GGUFWriter = Writer
    try:
        write_gguf(hf_dir, path, "qwen3", gguf.GGMLQuantizationType.F32)
    finally:
        gguf.GGUFWriter = real_writer
    return hf_dir, path


def test_a_yarn_gguf_reads_as_its_checkpoint(tmp_path):
    from flared.model.batch import ForwardBatch, SequenceChunk
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    hf_dir, path = _write_yarn_gguf(tmp_path, {})
    source, reference = read_source(path), read_source(hf_dir)
    assert source.config.rope_scaling == reference.config.rope_scaling
    model = DecoderModel(source.config, source.tensors)
    kv = model.make_kv_cache(num_pages=40, page_tokens=4)
    prompt = torch.randint(0, source.config.vocab_size, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = model.forward(ForwardBatch.build([SequenceChunk(prompt, 0, list(range(38)))], page_tokens=4), kv)[0]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
    assert (ours - expected).abs().max().item() < 1e-4


def test_a_gguf_yarn_we_do_not_compute_is_refused(tmp_path):
    from flared.model.loader import read_source

    _, path = _write_yarn_gguf(tmp_path, {"yarn_log_multiplier": 0.1})
    with pytest.raises(CoreError, match="yarn_log_multiplier") as info:
        read_source(path)
    assert info.value.kind == ErrorKind.UNSUPPORTED_MODEL
