"""Quantised Hugging Face checkpoints (GPTQ, AWQ, compressed-tensors, fp8 per tensor or channel) read dequantised:
each matrix the values its method's kernels multiply by, the same logits as transformers on those values; the
unsupported layouts refused by name.

The GPTQ and AWQ checkpoints here are packed by this file's own writers, from the layouts AutoGPTQ and AutoAWQ
write (their packages need CUDA builds); the compressed-tensors ones by compressed-tensors itself, and transformers
(with compressed-tensors) dequantises them for the reference logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from flared.errors import CoreError, ErrorKind  # noqa: E402
from flared.model.checkpoint_quant import AWQ_ORDER  # noqa: E402
from flared.model.decoder import DecoderModel  # noqa: E402
from flared.model.loader import read_source  # noqa: E402
from flared.model.quant import QuantPlan, resolve_quantization  # noqa: E402

from .conftest import build_hf_checkpoint  # noqa: E402
from flared_testing.checkpoints import hf_last_logits, last_logits  # noqa: E402

PROMPT = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(3)).tolist()


def _is_matrix(name: str, weight: torch.Tensor) -> bool:
    return name.endswith("proj.weight") and weight.dim() == 2  # (embeddings, norms and the LM head stay)


def _integer_grid(weight: torch.Tensor, groups: torch.Tensor, n_groups: int, bits: int, symmetric: bool, gen):
    """Per (output, input group): a scale (float16-exact), a zero point in [1, 2^bits - 1] and the weight rounded
    onto that grid; returns (q [out, in], scales [out, G], zeros [out, G]) as integers / float32."""
    out, inp = weight.shape
    top = (1 << bits) - 1
    scales = torch.empty(out, n_groups)
    zeros = torch.empty(out, n_groups, dtype=torch.int64)
    for g in range(n_groups):
        cols = weight[:, groups == g]
        lo, hi = cols.amin(1), cols.amax(1)
        if symmetric:
            scale = torch.maximum(lo.abs(), hi.abs()) * 2 / top
            zero = torch.full((out,), 1 << (bits - 1), dtype=torch.int64)
        else:
            scale = (hi - lo) / top
            zero = torch.clamp(torch.round(-lo / scale), 1, top).to(torch.int64)
        scales[:, g] = scale.half().float()
        zeros[:, g] = zero
    q = torch.clamp(torch.round(weight / scales[:, groups]) + zeros[:, groups], 0, top).to(torch.int64)
    return q, scales, zeros


def _pack_words(values: np.ndarray, bits: int) -> torch.Tensor:
    """[rows, n] integers -> int32 words [rows, n * bits / 32], each word's values from its low bits up."""
    per = 32 // bits
    v = values.astype(np.uint64).reshape(values.shape[0], -1, per)
    words = np.zeros(v.shape[:2], dtype=np.uint64)
    for j in range(per):
        words |= v[:, :, j] << np.uint64(j * bits)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def _quantised_checkpoint(tmp_path, quantize, quantization_config, family: str = "qwen3"):
    """(the quantised checkpoint, a plain one of the values it stands for): ``quantize(name, weight)`` gives a
    matrix's tensors (by suffix after the module name) and its values."""
    from safetensors.torch import load_file, save_file

    plain = build_hf_checkpoint(family, tmp_path / "plain")
    tensors = load_file(plain / "model.safetensors")
    quantised = {}
    for name, weight in tensors.items():
        if not _is_matrix(name, weight):
            quantised[name] = weight
            continue
        module = name[:-len("weight")]
        parts, values = quantize(name, weight)
        quantised.update({module + k: v for k, v in parts.items()})
        tensors[name] = values
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    directory = tmp_path / "quantised"
    directory.mkdir()
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))
    save_file(quantised, directory / "model.safetensors", metadata={"format": "pt"})
    return directory, plain


def _gptq(bits: int, group: int, *, v1: bool, act_order: bool, symmetric: bool):
    gen = torch.Generator().manual_seed(bits * 100 + group)

    def quantize(name, weight):
        out, inp = weight.shape
        n_groups = -(-inp // group)  # (a last group of fewer inputs where the group does not divide them)
        groups = (torch.randperm(inp, generator=gen) if act_order else torch.arange(inp)) // group
        q, scales, zeros = _integer_grid(weight, groups, n_groups, bits, symmetric, gen)
        stored_zeros = (zeros - 1 if v1 else zeros) & ((1 << bits) - 1)
        parts = {"qweight": _pack_words(q.numpy(), bits).t().contiguous(),  # [in * bits / 32, out]: along the inputs
                 "qzeros": _pack_words(stored_zeros.t().contiguous().numpy(), bits),  # [G, out * bits / 32]
                 "scales": scales.t().contiguous().half(),
                 "g_idx": groups.to(torch.int32)}
        return parts, scales[:, groups] * (q - zeros[:, groups]).float()

    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": symmetric,
              "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    return quantize, config


@pytest.mark.parametrize("bits, group, v1, act_order, symmetric", [
    (4, 32, True, False, True),  # (AutoGPTQ's usual release: v1 zeros, groups in order)
    (4, 32, True, True, True),  # (act-order: each input's group from g_idx)
    (4, 64, False, False, False),  # (gptq_v2 zeros, asymmetric)
    (8, 32, True, False, True),
    (2, 32, False, True, False),
])
def test_a_gptq_checkpoint_reads_as_its_values(tmp_path, bits, group, v1, act_order, symmetric):
    quantize, config = _gptq(bits, group, v1=v1, act_order=act_order, symmetric=symmetric)
    directory, plain = _quantised_checkpoint(tmp_path, quantize, config)
    _reads_as(directory, plain)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_an_older_quantisers_own_config_file_is_read(tmp_path, method):
    """AutoGPTQ's releases (TheBloke's) may carry their settings only in quantize_config.json, without a method
    name, and AutoAWQ's in quant_config.json (w_bit, q_group_size, version)."""
    from flared.core.sources import checkpoint_quantization

    quantize, config = _gptq(4, 32, v1=True, act_order=False, symmetric=True)
    directory, plain = _quantised_checkpoint(tmp_path, quantize, config)
    hf_config = json.loads((directory / "config.json").read_text())
    del hf_config["quantization_config"]
    (directory / "config.json").write_text(json.dumps(hf_config))
    if method == "gptq":
        (directory / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 32, "desc_act": False,
                                                                     "sym": True, "true_sequential": True}))
        ours, reference = read_source(directory), read_source(plain)
        assert torch.equal(ours.tensors["layers.1.down.weight"], reference.tensors["layers.1.down.weight"])
        assert checkpoint_quantization(directory) == ("q4_1", "gptq 4-bit in groups of 32")
    else:
        (directory / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": 32, "w_bit": 4,
                                                                  "version": "GEMV"}))
        with pytest.raises(CoreError, match="AWQ version 'gemv'"):
            read_source(directory)


def test_an_auto_round_checkpoint_reads_as_its_values(tmp_path):
    """Intel AutoRound's GPTQ layout (packing_format auto_round:auto_gptq, the original zeros), one module at 8 bits
    by its extra_config and one left at 16."""
    four, _ = _gptq(4, 32, v1=True, act_order=False, symmetric=True)
    eight, _ = _gptq(8, 32, v1=True, act_order=False, symmetric=True)

    def quantize(name, weight):
        if name == "model.layers.0.mlp.up_proj.weight":
            return {"weight": weight}, weight
        return (eight if name == "model.layers.1.mlp.down_proj.weight" else four)(name, weight)

    directory, plain = _quantised_checkpoint(tmp_path, quantize, {
        "quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "group_size": 32,
        "sym": True, "data_type": "int", "extra_config": {"model.layers.1.mlp.down_proj": {"bits": 8},
                                                          "model.layers.0.mlp.up_proj": {"bits": 16}}})
    _reads_as(directory, plain)
    quant = read_source(directory).quantization
    assert quant.integer_grid
    # (served as q4_1, the 8-bit module keeps 8 bits and the unquantised one stays bf16)
    assert quant.describe()["matrix_bits"] == {"layers.0.gate_up.weight": 16, "layers.1.down.weight": 8}
    assert resolve_quantization("q4_1", {"quantization": quant.describe()}) == QuantPlan(
        "q4_1", {"layers.0.gate_up.weight": None, "layers.1.down.weight": "q8_0"}, grids=True)
    assert resolve_quantization("q8_0", {"quantization": quant.describe()}) == QuantPlan(
        "q8_0", {"layers.0.gate_up.weight": None})


def test_an_awq_checkpoint_reads_as_its_values(tmp_path):
    gen = torch.Generator().manual_seed(7)
    reverse = [AWQ_ORDER.index(k) for k in range(8)]

    def pack_awq(values: torch.Tensor) -> torch.Tensor:  # [rows, out] -> [rows, out / 8], AutoAWQ's nibble order
        v = values.numpy().reshape(values.shape[0], -1, 8)
        return _pack_words(v[:, :, list(AWQ_ORDER)].reshape(values.shape[0], -1), 4)

    def quantize(name, weight):
        out, inp = weight.shape
        groups = torch.arange(inp) // 32
        q, scales, zeros = _integer_grid(weight, groups, inp // 32, 4, False, gen)
        parts = {"qweight": pack_awq(q.t().contiguous()), "qzeros": pack_awq(zeros.t().contiguous()),
                 "scales": scales.t().contiguous().half()}
        return parts, scales[:, groups] * (q - zeros[:, groups]).float()

    assert reverse == [0, 4, 1, 5, 2, 6, 3, 7]  # (the order AutoAWQ's unpacking restores)
    directory, plain = _quantised_checkpoint(tmp_path, quantize, {"quant_method": "awq", "bits": 4,
                                                                   "group_size": 32, "zero_point": True,
                                                                   "version": "gemm"})
    _reads_as(directory, plain)


@pytest.mark.parametrize("per_channel", [False, True])
def test_an_fp8_checkpoint_per_tensor_or_channel_reads_as_its_values(tmp_path, per_channel):
    def quantize(name, weight):
        scale = (weight.abs().amax(1, keepdim=True) if per_channel else weight.abs().amax().reshape(1)) / 448.0
        fp8 = (weight / scale).to(torch.float8_e4m3fn)
        return {"weight": fp8, "weight_scale": scale, "input_scale": torch.ones(1)}, fp8.float() * scale

    method = "fbgemm_fp8" if per_channel else "fp8"
    directory, plain = _quantised_checkpoint(tmp_path, quantize, {"quant_method": method,
                                                                   "activation_scheme": "static"})
    _reads_as(directory, plain)


def test_a_gptq_mixture_of_experts_reads_as_its_values(tmp_path):
    """Each routed expert (and the shared expert) a GPTQ module of its own, as GPTQ releases of Qwen MoE hold them."""
    quantize, config = _gptq(4, 32, v1=True, act_order=False, symmetric=True)
    directory, plain = _quantised_checkpoint(tmp_path, quantize, config, family="qwen2_moe")
    _reads_as(directory, plain, narrow_name="layers.1.experts.down.weight")


def _reads_as(directory, plain, narrow_name: str = "layers.1.down.weight"):
    ours, reference = read_source(directory), read_source(plain)
    assert ours.tensors.keys() == reference.tensors.keys()
    for name, value in reference.tensors.items():
        assert torch.equal(ours.tensors[name].float(), value.float()), name
    logits = last_logits(DecoderModel(ours.config, ours.tensors), PROMPT)
    assert (logits - hf_last_logits(plain, PROMPT)).abs().max().item() < 1e-4
    narrow = read_source(directory, dtype=torch.bfloat16)  # (an export to bf16 dequantises straight to it)
    assert torch.equal(narrow.tensors[narrow_name], reference.tensors[narrow_name].to(torch.bfloat16))
    assert ours.quantization is not None


# ---- compressed-tensors: packed by the library itself, dequantised by transformers for the reference


def _compressed_checkpoint(tmp_path, *, bits: int, kind: str, strategy: str, symmetric: bool, fmt: str):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(11)
    group = 32

    def quantize(name, weight):
        out, inp = weight.shape
        if kind == "float":
            scale = weight.abs().amax(1, keepdim=True) / 448.0
            fp8 = (weight / scale).to(torch.float8_e4m3fn)
            return {"weight": fp8, "weight_scale": scale}, fp8.float() * scale
        n_groups = inp // group if strategy == "group" else 1
        groups = torch.arange(inp) // group if strategy == "group" else torch.zeros(inp, dtype=torch.int64)
        q, scales, zeros = _integer_grid(weight, groups, n_groups, bits, symmetric, gen)
        offset = 1 << (bits - 1)  # (compressed-tensors keeps integers signed, about 0)
        q, zeros = q - offset, zeros - offset
        parts = {"weight_scale": scales}
        if fmt == "pack-quantized":
            parts["weight_packed"] = pack_to_int32(q.to(torch.int8), bits)
            parts["weight_shape"] = torch.tensor([out, inp])
            if not symmetric:
                parts["weight_zero_point"] = pack_to_int32(zeros.to(torch.int8), bits, packed_dim=0)
        else:
            parts["weight"] = q.to(torch.int8)
            if not symmetric:
                parts["weight_zero_point"] = zeros.to(torch.int8)
        values = scales[:, groups] * (q - zeros[:, groups]).float()
        return parts, values

    weights = {"num_bits": bits, "type": kind, "symmetric": symmetric, "strategy": strategy}
    if strategy == "group":
        weights["group_size"] = group
    config = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                            "output_activations": None}},
              "ignore": ["lm_head"], "version": ct.__version__}
    return _quantised_checkpoint(tmp_path, quantize, config)


@pytest.mark.parametrize("bits, kind, strategy, symmetric, fmt", [
    (4, "int", "group", True, "pack-quantized"),  # (W4A16, llm-compressor's default scheme)
    (4, "int", "group", False, "pack-quantized"),  # (asymmetric: zero points packed along the outputs)
    (8, "int", "channel", True, "pack-quantized"),  # (W8A16)
    (8, "int", "channel", True, "int-quantized"),  # (W8A8's weights)
    (8, "float", "channel", True, "float-quantized"),  # (FP8 dynamic)
])
def test_a_compressed_tensors_checkpoint_reads_as_transformers_dequantises_it(tmp_path, bits, kind, strategy,
                                                                            symmetric, fmt):
    directory, plain = _compressed_checkpoint(tmp_path, bits=bits, kind=kind, strategy=strategy,
                                              symmetric=symmetric, fmt=fmt)
    _reads_as(directory, plain)
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                              quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    ours = read_source(directory)
    q, k, v = ours.tensors["layers.0.qkv.weight"].split([128, 64, 64])
    assert torch.equal(q, hf.model.layers[0].self_attn.q_proj.weight.detach().float())
    assert torch.equal(v, hf.model.layers[0].self_attn.v_proj.weight.detach().float())
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0, -1]
    assert (last_logits(DecoderModel(ours.config, ours.tensors), PROMPT) - theirs).abs().max().item() < 1e-4


def test_an_exported_core_records_the_checkpoint_quantization(tmp_path):
    from flared.core.export import ExportOptions, export_core
    from flared.core.load import open_core
    from flared_testing.served import write_char_tokenizer

    quantize, config = _gptq(4, 32, v1=True, act_order=False, symmetric=True)
    directory, plain = _quantised_checkpoint(tmp_path, quantize, config)
    write_char_tokenizer(directory, 512)
    export_core(directory, tmp_path / "core", ExportOptions(concurrency=2, context_tokens=256,
                                                            prefill_chunk_tokens=128))
    core = open_core(tmp_path / "core")
    assert core.manifest.source["quantization"] == {"method": "gptq", "bits": 4, "group_size": 32,
                                                    "integer_grid": True}
    # (q4_1 of such a core searches each block's grid: QuantPlan.grids; q8_0 and other cores as before; every
    # module at 4 bits: no matrix_bits)
    assert resolve_quantization("q4_1", core.manifest.source) == QuantPlan("q4_1", grids=True)
    assert resolve_quantization("q8_0", core.manifest.source) == "q8_0"
    assert resolve_quantization("q4_1", {"kind": "hf"}) == "q4_1"
    assert torch.equal(core.load_tensors()["layers.0.o.weight"].float(),
                       read_source(plain).tensors["layers.0.o.weight"].float())


@pytest.mark.parametrize("quantization, what, kind", [
    ({"quant_method": "hqq", "nbits": 4}, "'hqq' is not supported", ErrorKind.UNSUPPORTED_MODEL),
    ({"quant_method": "auto-round", "packing_format": "auto_round:auto_awq", "bits": 2},
     r"AutoRound at \[2\] bits in AWQ's layout", ErrorKind.UNSUPPORTED_MODEL),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, "4-bit type 'int4'",
     ErrorKind.UNSUPPORTED_MODEL),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ at 3 bits", ErrorKind.UNSUPPORTED_MODEL),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'",
     ErrorKind.UNSUPPORTED_MODEL),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'", ErrorKind.UNSUPPORTED_MODEL),
    ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}}, "format 'marlin-24'",
     ErrorKind.UNSUPPORTED_MODEL),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float"}}}}, "4-bit float weights in",
     ErrorKind.UNSUPPORTED_MODEL),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size", ErrorKind.SOURCE_FORMAT),
])
def test_other_quantizations_are_refused_by_name(tmp_path, quantization, what, kind):
    hf_dir = build_hf_checkpoint("qwen3", tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(CoreError, match=what) as info:
        read_source(hf_dir)
    assert info.value.kind == kind


def test_a_float8_matrix_the_layout_does_not_name_is_refused(tmp_path):
    """An fp8 config without a block size over a block-scaled checkpoint (scales named weight_scale_inv): its float8
    matrices are named as unread, never served as their raw codes."""
    def quantize(name, weight):
        scale = weight.abs().amax(1, keepdim=True) / 448.0
        fp8 = (weight / scale).to(torch.float8_e4m3fn)
        return {"weight": fp8, "weight_scale_inv": scale}, fp8.float() * scale

    directory, _ = _quantised_checkpoint(tmp_path, quantize, {"quant_method": "fp8"})
    with pytest.raises(CoreError, match="float8_e4m3fn, quantised in a way a fp8 checkpoint does not lay out") as info:
        read_source(directory)
    assert info.value.kind == ErrorKind.SOURCE_FORMAT


def test_a_gptq_matrix_without_its_zeros_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    quantize, config = _gptq(4, 32, v1=True, act_order=False, symmetric=True)
    directory, _ = _quantised_checkpoint(tmp_path, quantize, config)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.qzeros"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CoreError, match="no tensor model.layers.1.mlp.up_proj.qzeros") as info:
        read_source(directory)
    assert info.value.kind == ErrorKind.SOURCE_FORMAT


def test_a_quantised_checkpoint_runs_at_about_its_bits_on_the_cpu(tmp_path):
    """Served directly on the CPU, a 4-bit GPTQ checkpoint's matrices stay 4-bit (q4_1) and an 8-bit one's 8-bit
    (q8_0), as `flared run` and `flarectl generate` take them where -q does not say otherwise."""
    import subprocess
    import sys

    from flared.core.sources import checkpoint_quantization, kept_quantization
    from flared_testing.served import write_char_tokenizer

    quantize, config = _gptq(4, 32, v1=True, act_order=False, symmetric=True)
    directory, plain = _quantised_checkpoint(tmp_path, quantize, config)
    assert checkpoint_quantization(directory) == ("q4_1", "gptq 4-bit in groups of 32")
    assert checkpoint_quantization(plain) == (None, "")
    config8 = json.loads((directory / "config.json").read_text())
    config8["quantization_config"] = {**config8["quantization_config"], "bits": 8}
    (tmp_path / "eight").mkdir()
    (tmp_path / "eight" / "config.json").write_text(json.dumps(config8))
    assert checkpoint_quantization(tmp_path / "eight")[0] == "q8_0"
    config8["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                      "bnb_4bit_quant_type": "nf4"}  # (levels no even grid holds: q8_0)
    (tmp_path / "eight" / "config.json").write_text(json.dumps(config8))
    assert checkpoint_quantization(tmp_path / "eight") == ("q8_0", "bitsandbytes nf4 4-bit")
    config8["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                      "config_groups": {"g": {"targets": ["Linear"], "weights": {
                                          "num_bits": 4, "type": "float", "group_size": 16}}}}
    (tmp_path / "eight" / "config.json").write_text(json.dumps(config8))
    assert checkpoint_quantization(tmp_path / "eight") == ("q8_0", "compressed-tensors fp4")
    fmt, _ = kept_quantization(directory)
    if fmt is None:
        pytest.skip("this machine keeps no checkpoint's bits (a GPU, or a CPU without the quantised kernels)")
    write_char_tokenizer(directory, 512)
    run = [sys.executable, "-m", "flared.cli.ctl", "generate", str(directory), "--cache-dir", str(tmp_path / "c"),
           "--prompt", "hello", "--max-tokens", "4", "--json"]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "gptq 4-bit in groups of 32: each run at about its bits" in proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["usage"]["completion_tokens"] == 4


NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
       0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]  # (bitsandbytes' NF4)


def _bnb4(nested: bool, blocksize: int = 64):
    """A writer of bitsandbytes' 4-bit serialisation (as transformers saves a load_in_4bit model): NF4 codes two a
    byte, the first in the high half; each block's absmax, double-quantised as uint8 codes into a 256-entry map
    times a float32 absmax a block of 256, plus an offset."""
    table = torch.tensor(NF4)
    nested_map = torch.linspace(-1, 1, 256)

    def quantize(name, weight):
        flat = weight.float().flatten()
        absmax = flat.reshape(-1, blocksize).abs().amax(1)
        parts, state = {}, {"quant_type": "nf4", "blocksize": blocksize, "dtype": "float32",
                            "shape": list(weight.shape)}
        if nested:
            offset = absmax.mean().item()
            centred = absmax - offset
            big = centred.reshape(-1, 256).abs().amax(1) if centred.numel() % 256 == 0 else centred.abs().amax()[None]
            scale = big.repeat_interleave(256)[:absmax.numel()]
            codes = (centred / scale)[:, None].sub(nested_map).abs().argmin(1)
            absmax = nested_map[codes] * scale + offset  # (what the checkpoint then stands for)
            parts.update({"weight.absmax": codes.to(torch.uint8), "weight.nested_absmax": big.clone(),
                          "weight.nested_quant_map": nested_map.clone()})
            state.update({"nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": offset})
        else:
            parts["weight.absmax"] = absmax
        codes = (flat / absmax.repeat_interleave(blocksize))[:, None].sub(table).abs().argmin(1)
        parts["weight"] = ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8)[:, None]
        parts["weight.quant_map"] = table.clone()
        parts["weight.quant_state.bitsandbytes__nf4"] = torch.tensor(list(json.dumps(state).encode()),
                                                                     dtype=torch.uint8)
        return parts, (table[codes] * absmax.repeat_interleave(blocksize)).reshape(weight.shape)

    return quantize


@pytest.mark.parametrize("nested", [False, True])
def test_a_bitsandbytes_4bit_checkpoint_reads_as_its_values(tmp_path, nested):
    directory, plain = _quantised_checkpoint(tmp_path, _bnb4(nested), {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": nested, "bnb_4bit_compute_dtype": "bfloat16"})
    _reads_as(directory, plain)


def test_a_bitsandbytes_8bit_checkpoint_reads_as_its_values(tmp_path):
    def quantize(name, weight):
        scb = weight.abs().amax(1)
        q = torch.round(weight / scb[:, None] * 127).to(torch.int8)
        return {"weight": q, "SCB": scb, "weight_format": torch.tensor(0, dtype=torch.uint8)}, \
            q.float() * scb[:, None] * (1.0 / 127)

    directory, plain = _quantised_checkpoint(tmp_path, quantize, {"quant_method": "bitsandbytes",
                                                                   "load_in_8bit": True})
    _reads_as(directory, plain)


def test_bitsandbytes_own_4bit_states_read_as_it_dequantises_them():
    """Where bitsandbytes is installed (it is not among the test extras: 125 MB), its own NF4 and FP4 states, with
    and without double quantisation, against its dequantize_4bit."""
    functional = pytest.importorskip("bitsandbytes.functional")
    from flared.model.checkpoint_quant import CheckpointQuantization, dequantize

    weight = torch.randn(96, 320, generator=torch.Generator().manual_seed(2))
    for kind in ("nf4", "fp4"):
        for nested in (False, True):
            q, state = functional.quantize_4bit(weight, blocksize=64, quant_type=kind, compress_statistics=nested)
            tensors = {"m.weight": q, **{f"m.weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
            dequantize(tensors, CheckpointQuantization("bitsandbytes", 4), torch.float32, source="bnb")
            assert torch.equal(tensors["m.weight"], functional.dequantize_4bit(q, state).float()), (kind, nested)


@pytest.mark.parametrize("fmt", ["nvfp4-pack-quantized", "mxfp4-pack-quantized"])
def test_an_fp4_compressed_tensors_checkpoint_reads_as_transformers_dequantises_it(tmp_path, fmt):
    """FP4 (E2M1) weights as llm-compressor's NVFP4 (groups of 16, float8 scales over a global scale) and MXFP4
    (groups of 32, power-of-two E8M0 scales) releases hold them, packed by this file's writer: our weights equal
    transformers' (with compressed-tensors) dequantisation of the same files."""
    ct = pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from flared.model.checkpoint_quant import E2M1

    nv = fmt.startswith("nv")
    group = 16 if nv else 32
    levels = torch.tensor(E2M1)
    signed = torch.cat([levels, -levels])  # (code c: sign c >= 8, magnitude c & 7)

    def quantize(name, weight):
        out, inp = weight.shape
        blocks = weight.reshape(out, inp // group, group)
        amax = blocks.abs().amax(-1)
        if nv:
            global_scale = 448.0 * 6.0 / weight.abs().amax()
            scales = (amax / 6.0 * global_scale).to(torch.float8_e4m3fn)
            effective = scales.float() / global_scale
        else:
            exponents = (127 + torch.floor(torch.log2(amax / 4.0))).to(torch.uint8)  # (6 may exceed: saturates)
            effective = torch.exp2(exponents.float() - 127)
        codes = (blocks / effective[..., None]).unsqueeze(-1).sub(signed).abs().argmin(-1).reshape(out, inp)
        values = signed[codes] * effective.repeat_interleave(group, 1)
        parts = {"weight_packed": (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8),
                 "weight_scale": scales if nv else exponents}
        if nv:
            parts["weight_global_scale"] = global_scale.reshape(1).float()
        return parts, values

    weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": group,
               "strategy": "tensor_group" if nv else "group"}
    if not nv:
        weights["scale_dtype"] = "torch.uint8"
    config = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
              "ignore": ["lm_head"], "version": ct.__version__}
    directory, plain = _quantised_checkpoint(tmp_path, quantize, config)
    ours = read_source(directory, dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16,
                                              quantization_config=CompressedTensorsConfig(run_compressed=False))
    q, k, v = ours.tensors["layers.0.qkv.weight"].split([128, 64, 64])
    assert torch.equal(q, hf.model.layers[0].self_attn.q_proj.weight.detach())
    assert torch.equal(ours.tensors["layers.1.down.weight"], hf.model.layers[1].mlp.down_proj.weight.detach())
    assert torch.equal(ours.tensors["layers.1.down.weight"],
                       read_source(plain).tensors["layers.1.down.weight"].to(torch.bfloat16))


def test_checkpoint_modules_map_to_their_serving_matrices():
    from flared.model.checkpoint_quant import serving_matrix

    assert serving_matrix("model.layers.3.self_attn.k_proj.") == "layers.3.qkv.weight"
    assert serving_matrix("model.layers.3.mlp.up_proj") == "layers.3.gate_up.weight"
    assert serving_matrix("model.layers.0.mlp.experts.17.down_proj.") == "layers.0.experts.down.weight"
    assert serving_matrix("model.layers.2.block_sparse_moe.experts.1.w3.") == "layers.2.experts.gate_up.weight"
    assert serving_matrix("model.layers.2.mlp.shared_expert.gate_proj.") == "layers.2.shared.gate_up.weight"
    assert serving_matrix("model.layers.2.mlp.shared_experts.down_proj.") == "layers.2.shared.down.weight"
    assert serving_matrix("lm_head.") is None and serving_matrix("model.layers.2.mlp.gate.") is None
