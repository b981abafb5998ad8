"""gpt-oss beyond the shared parity tests (test_parity_hf.py runs the gpt_oss family's logits, greedy tokens,
embeddings, prompt logprobs and bf16 drift against transformers; test_moe.py its grouped expert products): OpenAI's
MXFP4 expert weights, a GGUF as llama.cpp writes one, a served core."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from flared.model.config import ModelConfig  # noqa: E402
from flared.model.decoder import DecoderModel  # noqa: E402
from flared.model.loader import mxfp4_dequantize, read_source  # noqa: E402

from .conftest import build_hf_checkpoint  # noqa: E402
from .test_gguf_families import write_gguf  # noqa: E402
from flared_testing.checkpoints import hf_last_logits, last_logits  # noqa: E402


def _mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [..., G, 16] and scales [..., G] (powers of two around 2^-3)."""
    g = torch.Generator().manual_seed(seed)
    *rows, columns = shape
    blocks = torch.randint(0, 256, (*rows, columns // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 128, (*rows, columns // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _mxfp4((3, 10, 96), 0)
    ours = mxfp4_dequantize(blocks, scales)  # [E, out, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # transformers' [E, in, out]
    assert torch.equal(ours.float(), theirs.transpose(1, 2))
    assert ours.dtype == torch.bfloat16


def test_openai_mxfp4_experts_read_as_their_values(tmp_path):
    """A checkpoint as OpenAI released gpt-oss (the experts' products as *_blocks / *_scales, rows out-major) reads to
    the serving tensors of the same checkpoint holding the dequantized values in transformers' layout; its logits are
    transformers' on those values."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    plain = build_hf_checkpoint("gpt_oss", tmp_path / "plain")
    tensors = load_file(plain / "model.safetensors")
    packed = dict(tensors)
    for seed, name in enumerate(n for n in list(tensors) if n.endswith(("experts.gate_up_proj", "experts.down_proj"))):
        experts, rows, columns = tensors[name].transpose(1, 2).shape  # (the released layout: [E, out, in])
        blocks, scales = _mxfp4((experts, rows, columns), seed)
        tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    released = tmp_path / "released"
    released.mkdir()
    (released / "config.json").write_text((plain / "config.json").read_text())
    save_file(packed, released / "model.safetensors", metadata={"format": "pt"})

    ours, reference = read_source(released), read_source(plain)
    assert ours.tensors.keys() == reference.tensors.keys()
    for name, value in reference.tensors.items():
        assert torch.equal(ours.tensors[name].float(), value.float()), name
    prompt = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    assert (last_logits(DecoderModel(ours.config, ours.tensors), prompt)
            - hf_last_logits(plain, prompt)).abs().max().item() < 1e-4


def _truncated_yarn(hf_dir):
    """llama.cpp rounds YaRN's correction band out (truncate) for every model: so must the checkpoint a GGUF is
    compared with."""
    config = json.loads((hf_dir / "config.json").read_text())
    config["rope_parameters"]["truncate"] = True
    (hf_dir / "config.json").write_text(json.dumps(config))
    return hf_dir


def test_a_gguf_reads_as_its_checkpoint(tmp_path):
    """llama.cpp's gpt-oss: attn_sinks, the biased ffn_gate_inp, gate and up experts apart with their biases, the norm
    before the MLP named post_attention_norm, the even layers windowed; F32 logits equal the checkpoint's, and an
    MXFP4 file (as llama.cpp ships gpt-oss) reads its experts as gguf dequantizes them."""
    import gguf

    hf_dir = _truncated_yarn(build_hf_checkpoint("gpt_oss", tmp_path / "hf"))
    write_gguf(hf_dir, tmp_path / "m.gguf", "gpt-oss", Q.F32)
    source, reference = read_source(tmp_path / "m.gguf"), read_source(hf_dir)
    for field in ("layer_windows", "attention_sinks", "expert_bias", "router_topk_softmax", "num_experts",
                  "experts_per_token", "rope_scaling", "attention_bias", "attention_out_bias"):
        assert getattr(source.config, field) == getattr(reference.config, field), field
    prompt = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    # (the file carries llama.cpp's limit, 7, not the checkpoint's 1.5: compare with the checkpoint at 7)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "swiglu_limit": 7.0}))
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4

    write_gguf(hf_dir, tmp_path / "q.gguf", "gpt-oss", Q.MXFP4)
    quantized = read_source(tmp_path / "q.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "q.gguf"))
    stored = {t.name: t for t in reader.tensors}
    for ours_name, theirs in (("layers.1.experts.down.weight", "blk.1.ffn_down_exps.weight"),):
        t = stored[theirs]
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        assert t.tensor_type == Q.MXFP4 and torch.equal(quantized.tensors[ours_name], torch.from_numpy(values))


def test_config_round_trips_and_stays_out_of_the_graphs(tmp_path):
    config = read_source(build_hf_checkpoint("gpt_oss", tmp_path / "hf")).config
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert config.graph_obstacle == "gpt_oss layers" and config.float_norms
    assert config.layer_windows == (8, 0) and config.rope_scaling["truncate"] is False


def test_a_gpt_oss_core_serves_transformers_tokens(tmp_path):
    """Exported and served by flared run: greedy chat tokens equal transformers' generate on the same prompt ids."""
    from flared_testing.served import assert_served_greedy_equals_transformers

    directory = build_hf_checkpoint("gpt_oss", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert_served_greedy_equals_transformers(directory, hf, tmp_path)
