"""Block-scaled fp8 checkpoints (the *-FP8 releases of Qwen3, DeepSeek V3, MiniMax-M2, GLM-4.5: float8 matrices with a
weight_scale_inv per tile, quantization_config quant_method fp8) read dequantized: each tile its float8 values times
its scale, the same logits as transformers on those values (the other methods: test_checkpoint_quant.py)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flared.model.decoder import DecoderModel  # noqa: E402
from flared.model.loader import read_source  # noqa: E402

from .conftest import build_hf_checkpoint  # noqa: E402
from flared_testing.checkpoints import hf_last_logits, last_logits  # noqa: E402

BLOCK = (16, 32)


def _fp8_checkpoint(tmp_path):
    """(an fp8 checkpoint, the same model's plain checkpoint holding the values the fp8 one stands for)."""
    from safetensors.torch import load_file, save_file

    plain = build_hf_checkpoint("qwen3", tmp_path / "plain")
    tensors = load_file(plain / "model.safetensors")
    quantized = {}
    for name, weight in tensors.items():
        if not (name.endswith("proj.weight") and weight.dim() == 2):  # (embeddings, norms, the LM head stay)
            quantized[name] = weight
            continue
        rows, cols = weight.shape
        tiles = weight.reshape(rows // BLOCK[0], BLOCK[0], cols // BLOCK[1], BLOCK[1])
        scale = tiles.abs().amax(dim=(1, 3)) / 448.0  # float8_e4m3fn's largest
        fp8 = (tiles / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
        quantized[name], quantized[name + "_scale_inv"] = fp8, scale
        tensors[name] = (fp8.float().reshape(tiles.shape) * scale[:, None, :, None]).reshape(rows, cols)
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    fp8_dir = tmp_path / "fp8"
    fp8_dir.mkdir()
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    save_file(quantized, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    return fp8_dir, plain


def test_an_fp8_checkpoint_reads_as_its_values(tmp_path):
    fp8_dir, plain = _fp8_checkpoint(tmp_path)
    ours, reference = read_source(fp8_dir), read_source(plain)
    assert ours.tensors.keys() == reference.tensors.keys()
    for name, value in reference.tensors.items():
        assert torch.equal(ours.tensors[name].float(), value.float()), name
    prompt = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = last_logits(DecoderModel(ours.config, ours.tensors), prompt)
    assert (logits - hf_last_logits(plain, prompt)).abs().max().item() < 1e-4
    narrow = read_source(fp8_dir, dtype=torch.bfloat16)  # (an export to bf16 dequantizes straight to it)
    assert narrow.tensors["layers.0.o.weight"].dtype == torch.bfloat16
    assert torch.equal(narrow.tensors["layers.0.o.weight"], reference.tensors["layers.0.o.weight"].to(torch.bfloat16))
