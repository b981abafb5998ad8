"""Quantised Hugging Face checkpoints, read at export: every quantised matrix dequantised to the export's dtype.

What vLLM users download most besides plain checkpoints: GPTQ and AWQ releases (4-bit integers in groups, each
group a scale and a zero point), compressed-tensors ones (llm-compressor's W4A16, W8A16, W8A8 and FP8 releases) and
fp8 ones (per-tensor or per-channel scales; DeepSeek's block-scaled fp8 is loader._dequantize_fp8_blocks). The
quantization_config of config.json says which (``parse``); ``dequantize`` then replaces each quantised matrix's
tensors by ``<module>.weight`` holding its values, as the method's own kernels see them, and drops what a matrix
needs only for its kernels (activation scales, a KV cache's scales, packed shapes). The core keeps the values at the
export's dtype (a bf16 export rounds each value once); on a CPU ``--quantization`` keeps them at fewer bits again.

Layouts (each from the method's reference code):
- gptq: ``qweight`` int32 [in * bits / 32, out], the input rows packed bits at a time from the low bits up;
  ``qzeros`` int32 [groups, out * bits / 32] packed the same way along the outputs; ``scales`` [groups, out];
  ``g_idx`` [in] each input row's group (act-order checkpoints), else row // group_size. The value is
  scale * (q - zero), where the original ("gptq", v1) checkpoint format stores each zero less one.
- awq (GEMM): ``qweight`` int32 [in, out / 8] and ``qzeros`` [groups, out / 8], eight 4-bit outputs a word in the
  order 0, 2, 4, 6, 1, 3, 5, 7; ``scales`` [groups, out]; value scale * (q - zero), groups of group_size rows.
- compressed-tensors: ``weight_packed`` int32 [out, in * bits / 32] (pack-quantized, values stored offset by
  2^(bits - 1)) or ``weight`` int8 / float8; ``weight_scale`` per tensor, output channel, group of inputs or (fp8)
  block; ``weight_zero_point`` for asymmetric schemes (packed along the outputs for pack-quantized);
  ``weight_g_idx`` for act-order groups. The value is scale * (q - zero_point). FP4 (nvfp4- and
  mxfp4-pack-quantized): ``weight_packed`` uint8, two E2M1 values a byte (the first in the low half), times each
  group's ``weight_scale`` (NVFP4: float8 over 16 values, divided by ``weight_global_scale``; MXFP4: an E8M0
  exponent byte over 32).
- auto-round: GPTQ's layout (original zeros) or AWQ's, by ``packing_format``; ``extra_config`` widths a module.
- fp8 / fbgemm_fp8: ``weight`` float8 and ``weight_scale`` (one per tensor or per output channel).
- bitsandbytes, 4-bit (NF4 or FP4, as transformers saves them): ``weight`` uint8, two 4-bit codes a byte (the first
  in the high half), each a ``quant_map`` entry times its block's absmax (blocks of ``blocksize`` values in the
  matrix's flat order); a double-quantised absmax is uint8 codes into ``nested_quant_map`` times
  ``nested_absmax`` a block of ``nested_blocksize``, plus ``nested_offset``; the blocksize, shape and offset are
  JSON in ``weight.quant_state.bitsandbytes__nf4`` (or ``__fp4``). 8-bit (LLM.int8): ``weight`` int8 and ``SCB``,
  each row's absmax, the value weight * SCB / 127.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field

import torch

from flared.errors import CoreError, ErrorKind

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output k of a word sits in nibble AWQ_ORDER.index(k)
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# Tensors a quantised checkpoint carries for its own kernels only (activation and KV-cache scales, packed shapes):
# flared quantises neither activations nor (unless asked) its KV cache by these.
_KERNEL_ONLY = ("input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point",
                "weight_shape", "k_scale", "v_scale", "q_scale", "prob_scale", "input_scale_ub", "kv_scale",
                "weight_format")


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's quantization_config, checked: ``method`` (gptq, awq, compressed-tensors, fp8, fbgemm_fp8),
    ``bits`` the weights' bits where the config names one width (8 for fp8), ``group_size`` (None: per channel or
    per tensor), and the method's own settings in ``settings``."""
    method: str
    bits: int | None
    group_size: int | None = None
    settings: dict = field(default_factory=dict)
    widths: dict = field(default_factory=dict)  # (what dequantize found: each module's bits, 16 left unquantised)

    @property
    def integer_grid(self) -> bool:
        """Whether its values are integers times a scale less a zero point (GPTQ, AWQ, compressed-tensors' integer
        schemes), which quant.quantize_q4_1's ``grids`` search finds again."""
        return self.method in ("gptq", "awq", "auto-round") or (
            self.method == "compressed-tensors" and not self.settings.get("float"))

    def matrix_bits(self) -> dict[str, int]:
        """The serving layer matrices (``layers.3.qkv.weight``, a mixture's ``layers.3.experts.down.weight``) whose
        modules dequantize found at other widths than ``bits``: a fused matrix at the most among its parts."""
        out: dict[str, int] = {}
        for module, bits in self.widths.items():
            name = serving_matrix(module)
            if name is not None:
                out[name] = max(out.get(name, 0), bits)
        return {name: bits for name, bits in sorted(out.items()) if bits != self.bits}

    def describe(self) -> dict:
        """What an exported core's manifest records of it (``source.quantization``)."""
        out = {"method": self.method, "bits": self.bits, "integer_grid": self.integer_grid}
        if self.group_size:
            out["group_size"] = self.group_size
        if self.matrix_bits():
            out["matrix_bits"] = self.matrix_bits()
        return out


# A checkpoint module's name -> its layer and the serving matrix it goes into (Llama's names and the common MoE ones)
_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp|block_sparse_moe)\.(?:(experts)\.\d+\.|"
                     r"(shared_experts?)\.)?(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)$")
_ROLES = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up",
          "up_proj": "gate_up", "w1": "gate_up", "w3": "gate_up", "down_proj": "down", "w2": "down"}


def serving_matrix(module: str) -> str | None:
    """``model.layers.3.self_attn.k_proj`` -> ``layers.3.qkv.weight`` (None: no layer matrix of those names)."""
    m = _MODULE.search(module.rstrip("."))
    if m is None:
        return None
    layer, experts, shared, part = m.groups()
    role = _ROLES[part]
    if role in ("qkv", "o") and (experts or shared):
        return None
    prefix = "experts." if experts else "shared." if shared else ""
    return f"layers.{layer}.{prefix}{role}.weight"


def quantization_config_of(directory, hf_config: dict) -> object:
    """A checkpoint's quantization_config: config.json's (a vision-language model's may sit in its text_config), else
    the file older quantisers wrote beside it: AutoGPTQ's quantize_config.json (a GPTQ checkpoint, its method
    unnamed) or AutoAWQ's quant_config.json (w_bit, q_group_size, version); None for a plain checkpoint."""
    from pathlib import Path

    found = hf_config.get("quantization_config")
    if found is None and isinstance(hf_config.get("text_config"), dict):
        found = hf_config["text_config"].get("quantization_config")
    if found is not None:
        return found
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        path = Path(directory) / name
        if path.is_file():
            try:
                loaded = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise _malformed(str(path), f"not valid JSON: {exc}") from None
            if not isinstance(loaded, dict):
                raise _malformed(str(path), "not a JSON object")
            return {"quant_method": method, **loaded}
    return None


def _fail(source: str, message: str) -> CoreError:
    return CoreError(f"{source}: {message}", ErrorKind.UNSUPPORTED_MODEL)


def _malformed(source: str, message: str) -> CoreError:
    return CoreError(f"{source}: {message}", ErrorKind.SOURCE_FORMAT)


def parse(quantization: object, source: str) -> CheckpointQuantization | None:
    """config.json's ``quantization_config`` checked: None for an unquantised checkpoint and for the methods the
    loader reads elsewhere (gpt-oss' mxfp4, block-scaled fp8); a CoreError naming what is not supported."""
    if quantization is None:
        return None
    if not isinstance(quantization, dict):
        raise _malformed(source, "quantization_config is not an object")
    method = str(quantization.get("quant_method", "")).lower()
    if method in ("mxfp4",) or (method == "fp8" and quantization.get("weight_block_size") is not None):
        return None
    if method == "gptq":
        return _parse_gptq(quantization, source)
    if method in ("auto-round", "intel/auto-round"):
        return _parse_auto_round(quantization, source)
    if method == "awq":
        return _parse_awq(quantization, source)
    if method == "compressed-tensors":
        return _parse_compressed(quantization, source)
    if method in ("fp8", "fbgemm_fp8"):
        return CheckpointQuantization(method, 8)
    if method == "bitsandbytes":
        if quantization.get("load_in_4bit") or quantization.get("_load_in_4bit"):  # (transformers writes both)
            kind = str(quantization.get("bnb_4bit_quant_type", "fp4")).lower()
            if kind not in ("nf4", "fp4"):
                raise _fail(source, f"bitsandbytes 4-bit type {kind!r} is not supported (read: nf4, fp4)")
            return CheckpointQuantization("bitsandbytes", 4, settings={"type": kind})
        if quantization.get("load_in_8bit") or quantization.get("_load_in_8bit"):
            return CheckpointQuantization("bitsandbytes", 8)
        raise _malformed(source, "quantization_config bitsandbytes loads neither in 4 nor in 8 bits")
    raise _fail(source, f"quantization_config {method or quantization.get('quant_method')!r} is not supported (read: "
                        "gptq, awq, auto-round, compressed-tensors, fp8 (per tensor, channel or block), fbgemm_fp8, "
                        "bitsandbytes, gpt-oss' mxfp4, or an unquantized checkpoint)")


def _positive_or_none(value, what: str, source: str) -> int | None:
    if value in (None, -1, 0):
        return None
    if not isinstance(value, int) or value < 0:
        raise _malformed(source, f"quantization_config {what} {value!r} is not a positive integer or -1")
    return value


def _parse_gptq(q: dict, source: str) -> CheckpointQuantization:
    bits = q.get("bits")
    if bits not in (2, 4, 8):
        raise _fail(source, f"GPTQ at {bits!r} bits is not supported (read: 2, 4 and 8 bits; 3-bit packing is not)")
    fmt = str(q.get("checkpoint_format") or q.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _fail(source, f"GPTQ checkpoint_format {fmt!r} is not supported (read: gptq, gptq_v2)")
    if str(q.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise _fail(source, f"GPTQ pack_dtype {q.get('pack_dtype')!r} is not supported (read: int32)")
    group = _positive_or_none(q.get("group_size"), "group_size", source)
    return CheckpointQuantization("gptq", bits, group, {"v1": fmt == "gptq", "dynamic": bool(q.get("dynamic"))})


def _parse_auto_round(q: dict, source: str) -> CheckpointQuantization:
    """Intel's AutoRound releases: integers in GPTQ's layout (packing_format auto_round:auto_gptq, the original
    format's zeros) or AWQ's (auto_round:auto_awq), per-module widths in ``extra_config`` (16: left unquantised)."""
    layout = str(q.get("packing_format", "auto_round:auto_gptq")).lower()
    if q.get("data_type", "int") != "int":
        raise _fail(source, f"AutoRound data_type {q.get('data_type')!r} is not supported (read: int)")
    if layout not in ("auto_round:auto_gptq", "auto_round:gptq", "auto_round:auto_awq", "auto_round:awq"):
        raise _fail(source, f"AutoRound packing_format {layout!r} is not supported (read: auto_round:auto_gptq, "
                            "auto_round:auto_awq)")
    awq = layout.endswith("awq")
    extra = q.get("extra_config") or {}
    module_bits = {name: cfg["bits"] for name, cfg in extra.items() if isinstance(cfg, dict) and "bits" in cfg}
    widths = {q.get("bits"), *(b for b in module_bits.values() if b < 16)}
    if not widths <= ({4} if awq else {2, 4, 8}):
        raise _fail(source, f"AutoRound at {sorted(w for w in widths if w is not None)} bits in "
                            f"{'AWQ' if awq else 'GPTQ'}'s layout is not supported (read: "
                            f"{'4' if awq else '2, 4 and 8'} bits)")
    group = _positive_or_none(q.get("group_size"), "group_size", source)
    return CheckpointQuantization("auto-round", q.get("bits"), group,
                                  {"layout": "awq" if awq else "gptq", "v1": True, "module_bits": module_bits})


def _parse_awq(q: dict, source: str) -> CheckpointQuantization:
    bits = q.get("bits", q.get("w_bit"))
    version = str(q.get("version", "gemm")).lower()
    if bits != 4:
        raise _fail(source, f"AWQ at {bits!r} bits is not supported (read: 4 bits)")
    if version != "gemm":
        raise _fail(source, f"AWQ version {version!r} is not supported (read: the GEMM layout, AutoAWQ's default)")
    if q.get("zero_point", True) is False:
        raise _fail(source, "AWQ without zero points is not supported")
    group = _positive_or_none(q.get("group_size", q.get("q_group_size")), "group_size", source)
    return CheckpointQuantization("awq", 4, group)


_CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized", "nvfp4-pack-quantized",
               "mxfp4-pack-quantized", "dense")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # FP4's magnitudes by its low three bits (the fourth: the sign)


def _parse_compressed(q: dict, source: str) -> CheckpointQuantization:
    status = q.get("quantization_status", "compressed")
    if status not in ("compressed", None):
        raise _fail(source, f"compressed-tensors quantization_status {status!r} is not supported (read: compressed "
                            "checkpoints, as llm-compressor saves them)")
    sparsity = q.get("sparsity_config")
    if isinstance(sparsity, dict) and sparsity.get("format", "dense") != "dense":
        raise _fail(source, f"compressed-tensors sparsity format {sparsity.get('format')!r} is not supported")
    if q.get("transform_config"):
        raise _fail(source, "compressed-tensors transforms (rotations such as SpinQuant's) are not supported")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise _malformed(source, "quantization_config.config_groups is not an object")
    widths, group_sizes, blocks = set(), set(), set()
    floats = False
    top = q.get("format")
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise _malformed(source, f"quantization_config.config_groups.{name} is not an object")
        weights = group.get("weights")
        fmt = group.get("format") or top
        if weights is None:
            continue  # (activations only: the weights stay dense)
        if not isinstance(weights, dict):
            raise _malformed(source, f"config_groups.{name}.weights is not an object")
        kind = weights.get("type", "int")
        bits = weights.get("num_bits")
        if fmt not in _CT_FORMATS:
            raise _fail(source, f"compressed-tensors format {fmt!r} is not supported (read: "
                                f"{', '.join(_CT_FORMATS)})")
        if kind == "int" and bits not in (4, 8):
            raise _fail(source, f"compressed-tensors {bits!r}-bit integer weights are not supported (read: 4 and 8)")
        if kind == "float" and not (bits == 8 or (bits == 4 and fmt.endswith("fp4-pack-quantized"))):
            raise _fail(source, f"compressed-tensors {bits!r}-bit float weights in {fmt!r} are not supported (read: "
                                "fp8, and fp4 as nvfp4- or mxfp4-pack-quantized)")
        if kind not in ("int", "float"):
            raise _fail(source, f"compressed-tensors weight type {kind!r} is not supported")
        widths.add(bits)
        floats |= kind == "float"
        if weights.get("group_size"):
            group_sizes.add(weights["group_size"])
        if weights.get("block_structure"):
            blocks.add(tuple(weights["block_structure"]))
    if len(blocks) > 1:
        raise _fail(source, f"compressed-tensors groups of several block structures ({sorted(blocks)})")
    return CheckpointQuantization(
        "compressed-tensors", next(iter(widths)) if len(widths) == 1 else None,
        next(iter(group_sizes)) if len(group_sizes) == 1 else None,
        {"widths": sorted(widths), "block": next(iter(blocks)) if blocks else None, "float": floats})


# ---------------------------------------------------------------------------------------------- dequantization


def dequantize(hf: dict[str, torch.Tensor], quant: CheckpointQuantization, dtype: torch.dtype, *,
               source: str) -> None:
    """Every quantised matrix of ``hf`` (a checkpoint's tensors by name) as ``<module>.weight`` in ``dtype``, in
    place, a matrix at a time (its packed tensors dropped as its values land); the kernels' own tensors dropped."""
    steps = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed, "fp8": _fp8, "fbgemm_fp8": _fp8,
             "bitsandbytes": _bitsandbytes}
    steps[quant.settings.get("layout", quant.method)](hf, quant, dtype, source)
    for name in [n for n in hf if n.rsplit(".", 1)[-1] in _KERNEL_ONLY]:
        del hf[name]
    for name, value in hf.items():  # (a layer matrix the checkpoint left unquantised: ignored, or AutoRound's 16)
        module = name[:-len("weight")]
        if name.endswith(".weight") and module not in quant.widths and value.dim() >= 2 and \
                value.is_floating_point() and value.dtype not in _FLOAT8 and serving_matrix(module) is not None:
            quant.widths[module] = 16
    left = [n for n, t in hf.items() if n.endswith("weight") and t.dtype in (*_FLOAT8, torch.int8, torch.uint8,
                                                                               torch.int32)]
    if left:  # (a quantised matrix whose tensors this method's layout does not name: never served as raw codes)
        raise _malformed(source, f"{left[0]} is {hf[left[0]].dtype}, quantised in a way a {quant.method} checkpoint "
                                 f"does not lay out{f' ({len(left)} such matrices)' if len(left) > 1 else ''}")


def _nibbles(raw: torch.Tensor, high_first: bool = False) -> torch.Tensor:
    """uint8 bytes [..., n] -> their 4-bit halves [..., 2 n], each byte's low half first (or its high half)."""
    low, high = raw & 15, raw >> 4
    return torch.stack((high, low) if high_first else (low, high), dim=-1).flatten(-2)


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., n] -> their values [..., n * 32 / bits], each word's from its low bits up (uint8 at 4 and 8
    bits, through the words' little-endian bytes: a byte's low half first; int32 at 2)."""
    if bits in (4, 8) and sys.byteorder == "little":
        raw = words.contiguous().view(torch.uint8)  # [..., n * 4]
        return raw if bits == 8 else _nibbles(raw)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def _take(hf: dict, name: str, source: str, dtypes: tuple | None = None) -> torch.Tensor:
    value = hf.pop(name, None)
    if value is None:
        raise _malformed(source, f"the checkpoint has no tensor {name}")
    if dtypes is not None and value.dtype not in dtypes:
        raise _malformed(source, f"tensor {name} is {value.dtype}, expected {' or '.join(map(str, dtypes))}")
    return value


def _grouped(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, groups: torch.Tensor
             ) -> torch.Tensor:
    """scale * (q - zero), float32, for q [out, in] and scales / zeros [out, G] picked by each input's group (where
    the groups are equal runs in order, by broadcasting over [out, G, in / G] rather than a gather)."""
    out_features, in_features = values.shape
    n_groups = scales.shape[1]
    if in_features % n_groups == 0 and torch.equal(
            groups, torch.arange(in_features, dtype=groups.dtype) // (in_features // n_groups)):
        shifted = values.reshape(out_features, n_groups, -1).float()
        if zeros is not None:
            shifted -= zeros.float().unsqueeze(-1)
        return (shifted * scales.float().unsqueeze(-1)).view(out_features, in_features)
    scale = scales.float().index_select(1, groups)
    shifted = values.float() if zeros is None else values.float() - zeros.float().index_select(1, groups)
    return shifted * scale


def _input_groups(in_features: int, n_groups: int, g_idx: torch.Tensor | None, name: str, source: str,
                  group_size: int | None = None) -> torch.Tensor:
    """Each input's group: ``g_idx`` where the checkpoint has one, else runs of ``group_size`` (the config's; the
    last group may be short) or, without one, ``n_groups`` equal runs."""
    if g_idx is not None:
        g = g_idx.to(torch.int64).flatten()
        if g.numel() != in_features or (g.numel() and (int(g.min()) < 0 or int(g.max()) >= n_groups)):
            raise _malformed(source, f"{name}'s group index does not give each of {in_features} inputs one of "
                                     f"{n_groups} groups")
        return g
    if group_size and -(-in_features // group_size) == n_groups:
        return torch.arange(in_features, dtype=torch.int64) // group_size
    if n_groups < 1 or in_features % n_groups:
        raise _malformed(source, f"{name}: {in_features} inputs do not split into {n_groups} equal groups")
    return torch.arange(in_features, dtype=torch.int64) // (in_features // n_groups)


def _gptq(hf: dict, quant: CheckpointQuantization, dtype: torch.dtype, source: str) -> None:
    for name in [n for n in hf if n.endswith(".qweight")]:
        module = name[:-len("qweight")]
        qweight = _take(hf, name, source, (torch.int32,))
        qzeros = _take(hf, module + "qzeros", source, (torch.int32,))
        scales = _take(hf, module + "scales", source)
        g_idx = hf.pop(module + "g_idx", None)
        bits = quant.settings.get("module_bits", {}).get(module[:-1], quant.bits)  # (AutoRound's extra_config)
        if quant.settings.get("dynamic") and g_idx is not None and g_idx.numel() and \
                (qweight.shape[0] * 32) % g_idx.numel() == 0:
            bits = qweight.shape[0] * 32 // g_idx.numel()  # (per-module widths: GPTQModel's "dynamic")
        if qweight.dim() != 2 or scales.dim() != 2 or scales.shape[1] != qweight.shape[1] \
                or qzeros.shape != (scales.shape[0], qweight.shape[1] * bits // 32) or bits not in (2, 4, 8):
            raise _malformed(source, f"{module}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and "
                                     f"scales {tuple(scales.shape)} are not a {bits}-bit GPTQ matrix")
        values = _unpack(qweight.t().contiguous(), bits)  # [out, in]
        zeros = _unpack(qzeros, bits).t()  # [out, groups]
        if quant.settings.get("v1", True):
            zeros = zeros + 1  # (the original format stores each zero less one)
        groups = _input_groups(values.shape[1], scales.shape[0], g_idx, module + "qweight", source, quant.group_size)
        hf[module + "weight"] = _grouped(values, scales.t(), zeros, groups).to(dtype)
        quant.widths[module] = bits


def _awq(hf: dict, quant: CheckpointQuantization, dtype: torch.dtype, source: str) -> None:
    reverse = torch.tensor([AWQ_ORDER.index(k) for k in range(8)])
    for name in [n for n in hf if n.endswith(".qweight")]:
        module = name[:-len("qweight")]
        qweight = _take(hf, name, source, (torch.int32,))
        qzeros = _take(hf, module + "qzeros", source, (torch.int32,))
        scales = _take(hf, module + "scales", source)
        if qweight.dim() != 2 or scales.dim() != 2 or scales.shape[1] != qweight.shape[1] * 8 \
                or qzeros.shape != (scales.shape[0], qweight.shape[1]):
            raise _malformed(source, f"{module}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and "
                                     f"scales {tuple(scales.shape)} are not a 4-bit AWQ matrix")

        def natural(words: torch.Tensor) -> torch.Tensor:  # [rows, out / 8] words -> [rows, out] in output order
            nibbles = _unpack(words, 4).view(words.shape[0], -1, 8)
            return nibbles.index_select(2, reverse).flatten(1)

        values = natural(qweight).t()  # [out, in]
        groups = _input_groups(values.shape[1], scales.shape[0], None, module + "qweight", source, quant.group_size)
        hf[module + "weight"] = _grouped(values, scales.t(), natural(qzeros).t(), groups).to(dtype)
        quant.widths[module] = 4


def _scale_of(scale: torch.Tensor, out_features: int, in_features: int, block, module: str,
              source: str) -> tuple[str, torch.Tensor]:
    """A compressed-tensors or fp8 scale's strategy ("tensor", "channel", "group", "block") and the scale
    [out, G] (per tensor and channel: G = 1), or [out / bh, in / bw] for blocks."""
    s = scale.float()
    if s.numel() == 1:
        return "tensor", s.reshape(1, 1).expand(out_features, 1)
    if s.dim() == 1 and s.numel() == out_features:
        return "channel", s.reshape(out_features, 1)
    if s.dim() == 2 and s.shape[0] == out_features:
        return ("channel" if s.shape[1] == 1 else "group"), s
    if s.dim() == 2 and block is not None and s.shape == (-(-out_features // block[0]), -(-in_features // block[1])):
        return "block", s
    raise _malformed(source, f"{module}weight_scale {tuple(scale.shape)} scales no matrix "
                             f"[{out_features}, {in_features}] by tensor, channel, group of inputs or block")


def _apply_scale(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, strategy: str, block,
                 g_idx: torch.Tensor | None, module: str, source: str, group_size: int | None = None) -> torch.Tensor:
    out_features, in_features = q.shape
    if strategy == "block":
        bh, bw = block
        tiles = scale.repeat_interleave(bh, 0)[:out_features].repeat_interleave(bw, 1)[:, :in_features]
        values = q.float() if zero is None else q.float() - zero.float().repeat_interleave(bh, 0)[
            :out_features].repeat_interleave(bw, 1)[:, :in_features]
        return values * tiles
    groups = _input_groups(in_features, scale.shape[1], g_idx, module + "weight", source, group_size)
    if zero is not None:
        zero = zero.reshape(scale.shape) if zero.numel() == scale.numel() else zero.reshape(-1, 1).expand(scale.shape)
    return _grouped(q, scale, zero, groups)


def _compressed(hf: dict, quant: CheckpointQuantization, dtype: torch.dtype, source: str) -> None:
    block = quant.settings.get("block")
    widths = quant.settings.get("widths") or [4, 8]
    modules = sorted({n.rsplit(".", 1)[0] + "." for n in hf if n.endswith((".weight_packed", ".weight_scale"))})
    for module in modules:
        scale_t = _take(hf, module + "weight_scale", source)
        zero_t = hf.pop(module + "weight_zero_point", None)
        g_idx = hf.pop(module + "weight_g_idx", None)
        if module + "weight_packed" in hf and hf[module + "weight_packed"].dtype == torch.uint8:
            hf[module + "weight"] = _fp4(_take(hf, module + "weight_packed", source), scale_t,
                                         hf.pop(module + "weight_global_scale", None), module, source).to(dtype)
            quant.widths[module] = 4
            continue
        if module + "weight_packed" in hf:
            packed = _take(hf, module + "weight_packed", source, (torch.int32,))
            shape = hf.get(module + "weight_shape")
            if shape is None:
                raise _malformed(source, f"{module}weight_packed has no weight_shape beside it")
            shape = [int(v) for v in shape.flatten()]
            bits = next((b for b in widths if b in (4, 8) and packed.shape[-1] == -(-shape[-1] * b // 32)), None)
            if bits is None or list(packed.shape[:-1]) != shape[:-1]:
                raise _malformed(source, f"{module}weight_packed {tuple(packed.shape)} holds no {shape} matrix of "
                                         f"{' or '.join(map(str, widths))}-bit values")
            q = _unpack(packed, bits)[..., :shape[-1]].to(torch.int16) - (1 << (bits - 1))  # (stored offset)
            width = bits
            if zero_t is not None and zero_t.dtype == torch.int32:  # (packed along the outputs)
                rows = shape[-2]
                zero_t = (_unpack(zero_t.transpose(-1, -2).contiguous(), bits)[..., :rows].to(torch.int16)
                          - (1 << (bits - 1))).transpose(-1, -2)
        else:
            q = _take(hf, module + "weight", source)
            if q.dtype not in (torch.int8, *_FLOAT8):
                raise _fail(source, f"{module}weight is {q.dtype} beside a weight_scale: a checkpoint saved "
                                    "uncompressed (fake-quantised) is not supported; save it compressed")
            width = 8  # (int8 or fp8 weights)
        quant.widths[module] = width
        if q.dim() == 3:  # (a mixture's experts stacked)
            parts = [_dequant_matrix(q[e], scale_t[e], None if zero_t is None else zero_t[e],
                                     None if g_idx is None else g_idx[e], block, module, source, quant.group_size)
                     for e in range(q.shape[0])]
            hf[module + "weight"] = torch.stack(parts).to(dtype)
        elif q.dim() == 2:
            hf[module + "weight"] = _dequant_matrix(q, scale_t, zero_t, g_idx, block, module, source,
                                                    quant.group_size).to(dtype)
        else:
            raise _malformed(source, f"{module}weight is {tuple(q.shape)}, not a matrix")


def _fp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None, module: str,
         source: str) -> torch.Tensor:
    """compressed-tensors' FP4 (E2M1) matrix: two values a byte, the first in the low half, each group's scale
    float8 divided by the tensor's global scale (NVFP4, groups of 16) or a power of two 2^(e - 127) (MXFP4's E8M0
    byte, groups of 32)."""
    if packed.dim() != 2 or scale.dim() != 2 or scale.shape[0] != packed.shape[0] or \
            (packed.shape[1] * 2) % scale.shape[1]:
        raise _malformed(source, f"{module}weight_packed {tuple(packed.shape)} and weight_scale "
                                 f"{tuple(scale.shape)} are no FP4 matrix in groups")
    codes = _nibbles(packed).long()  # (the low half first)
    values = torch.tensor(E2M1)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    if scale.dtype == torch.uint8:  # (MXFP4: E8M0 exponents)
        scales = torch.exp2(scale.float() - 127.0)
    else:
        scales = scale.float()
        if global_scale is not None:
            scales = scales / global_scale.float().flatten()[0]
    group = values.shape[1] // scales.shape[1]
    return values * scales.repeat_interleave(group, dim=1)


def _dequant_matrix(q, scale_t, zero_t, g_idx, block, module, source, group_size) -> torch.Tensor:
    strategy, scale = _scale_of(scale_t, q.shape[0], q.shape[1], block, module, source)
    return _apply_scale(q, scale, zero_t, strategy, block, g_idx, module, source, group_size)


def _fp8(hf: dict, quant: CheckpointQuantization, dtype: torch.dtype, source: str) -> None:
    for name in [n for n in hf if n.endswith(".weight_scale")]:
        module = name[:-len("weight_scale")]
        scale_t = _take(hf, name, source)
        weight = _take(hf, module + "weight", source, _FLOAT8)
        if weight.dim() != 2:
            raise _malformed(source, f"{module}weight is {tuple(weight.shape)}, not a matrix")
        strategy, scale = _scale_of(scale_t, weight.shape[0], weight.shape[1], None, module, source)
        if strategy not in ("tensor", "channel"):
            raise _malformed(source, f"{module}weight_scale {tuple(scale_t.shape)} is neither one scale nor one an "
                                     "output channel")
        hf[module + "weight"] = (weight.float() * scale).to(dtype)
        quant.widths[module] = 8


def _bitsandbytes(hf: dict, quant: CheckpointQuantization, dtype: torch.dtype, source: str) -> None:
    for name in [n for n in hf if ".weight.quant_state.bitsandbytes__" in n]:
        weight_name = name.split(".quant_state.")[0]
        blob = hf.pop(name)
        try:
            state = json.loads(bytes(blob.to(torch.uint8).flatten().tolist()).decode("utf-8"))
            shape = [int(v) for v in state["shape"]]
            blocksize = int(state["blocksize"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise _malformed(source, f"{name} is not bitsandbytes' quant state ({exc})") from None
        packed = _take(hf, weight_name, source, (torch.uint8,)).flatten()
        quant_map = _take(hf, weight_name + ".quant_map", source).float().flatten()
        absmax = _take(hf, weight_name + ".absmax", source)
        if weight_name + ".nested_absmax" in hf:  # (double quantisation: the absmax as uint8 codes)
            nested = _take(hf, weight_name + ".nested_absmax", source).float().flatten()
            nested_map = _take(hf, weight_name + ".nested_quant_map", source).float().flatten()
            per = int(state.get("nested_blocksize", 256))
            absmax = (nested_map[absmax.long().flatten()] * nested.repeat_interleave(per)[:absmax.numel()]
                      + float(state.get("nested_offset", 0.0)))
        absmax = absmax.float().flatten()
        count = math.prod(shape)
        if len(shape) != 2 or quant_map.numel() != 16 or packed.numel() * 2 < count or \
                absmax.numel() != -(-count // blocksize):
            raise _malformed(source, f"{weight_name}: {packed.numel()} bytes, {absmax.numel()} block scales and a "
                                     f"map of {quant_map.numel()} hold no {shape} matrix in blocks of {blocksize}")
        codes = _nibbles(packed, high_first=True)[:count].long()
        values = quant_map[codes] * absmax.repeat_interleave(blocksize)[:count]
        hf[weight_name] = values.reshape(shape).to(dtype)
        quant.widths[weight_name[:-len("weight")]] = 4
    for name in [n for n in hf if n.endswith(".SCB")]:  # (LLM.int8: each row's absmax)
        weight_name = name[:-len("SCB")] + "weight"
        scb = hf.pop(name).float().flatten()
        weight = _take(hf, weight_name, source, (torch.int8,))
        if weight.dim() != 2 or scb.numel() != weight.shape[0]:
            raise _malformed(source, f"{name} {scb.numel()} scales for {weight_name} {tuple(weight.shape)}")
        hf[weight_name] = (weight.float() * scb[:, None] * (1.0 / 127)).to(dtype)  # (bitsandbytes' order)
        quant.widths[weight_name[:-len("weight")]] = 8
