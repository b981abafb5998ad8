"""LoRA adapters in PEFT's format, merged into a core's weights at load (as llama.cpp's ``--lora`` does).

An adapter is a directory holding ``adapter_config.json`` and ``adapter_model.safetensors`` (what PEFT's
``save_pretrained`` writes and what the Hugging Face hub serves). Each targeted linear layer W gets
``W + scale * s * B @ A``, where ``s`` is the adapter's own scaling (``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with rsLoRA; per-module ``alpha_pattern`` honoured) and ``scale`` the operator's
(``--lora-scaled``). Targets: the attention and MLP projections (q/k/v into the fused qkv rows, o, gate/up
into the fused gate_up rows, down; Phi-3's and GLM-4's own fused qkv_proj / gate_up_proj; GLM-4's q/k rows in the
loader's rotate-half order; a mixture-of-experts model's attention only), ``lm_head`` and ``embed_tokens`` when the
model does not tie them.
The sum is taken in float32 and rounded once to the weight's dtype.

Refused, each with an error naming the adapter and what is wrong: DoRA, trained biases, ``modules_to_save``
(whole replaced layers), fan-in/fan-out (Conv1D) layouts, a tied embedding or LM head as a target, an
unknown module, an A without its B, and shapes that do not fit the model.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from flared.errors import CoreError, ErrorKind

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# base_model.model.<module>.<lora_A|lora_B|lora_embedding_A|lora_embedding_B>[.<adapter name>][.weight]
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B)"
                  r"(?:\.(?!weight$)[^.]+)?(?:\.weight)?$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.(?:q|k|v|o|qkv)_proj|mlp\.(?:gate|up|down|gate_up)_proj)$")


@dataclass(frozen=True)
class LoraAdapter:
    path: Path  # the adapter's directory
    scale: float = 1.0


def adapter_dir(path: str | Path) -> Path:
    """The adapter directory of ``path`` (the directory, or its adapter_model.safetensors)."""
    p = Path(path).expanduser()
    try:
        weights_file = p.name == WEIGHTS_NAME and p.is_file()
    except (OSError, ValueError):  # a NUL byte, a name too long: check_adapter_path says so
        weights_file = False
    return p.parent if weights_file else p


def check_adapter_path(path: str | Path) -> str | None:
    """Why ``path`` is not a PEFT adapter directory, or None."""
    try:
        d = adapter_dir(path)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (d / name).is_file():
                return f"{d} has no {name} (a PEFT LoRA adapter directory holds {CONFIG_NAME} and {WEIGHTS_NAME})"
    except (OSError, ValueError) as e:  # a NUL byte, a name too long, a path the process may not look at
        return f"{str(path)[:200]!r} is not a usable path: {e}"
    return None


def _bad(adapter: Path, what: str, kind: ErrorKind = ErrorKind.SOURCE_FORMAT) -> CoreError:
    return CoreError(f"LoRA adapter {adapter}: {what}", kind)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank/alpha patterns: the first key that matches the module name's end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter(path: str | Path) -> tuple[dict, dict, bytes]:
    """(adapter_config, tensors, SHA-256 of both files) of a PEFT adapter directory, after the checks of what can
    be merged. Each file is read once; the digest is what prefix-cache identities derive from."""
    from safetensors.torch import load

    d = adapter_dir(path)
    problem = check_adapter_path(d)
    if problem:
        raise CoreError(problem, ErrorKind.SOURCE_FORMAT)
    try:
        config_bytes = (d / CONFIG_NAME).read_bytes()
        cfg = json.loads(config_bytes.decode("utf-8"))
    except (OSError, ValueError) as e:
        raise _bad(d, f"{CONFIG_NAME} is not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise _bad(d, f"{CONFIG_NAME} is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise _bad(d, f"peft_type {cfg.get('peft_type')!r} is not LORA", ErrorKind.UNSUPPORTED_MODEL)
    if cfg.get("use_dora"):
        raise _bad(d, "DoRA adapters (use_dora) are not supported", ErrorKind.UNSUPPORTED_MODEL)
    if cfg.get("fan_in_fan_out"):
        raise _bad(d, "fan_in_fan_out (Conv1D layouts) is not supported", ErrorKind.UNSUPPORTED_MODEL)
    if cfg.get("bias", "none") not in ("none", None):
        raise _bad(d, f"trained biases (bias={cfg.get('bias')!r}) are not supported", ErrorKind.UNSUPPORTED_MODEL)
    if cfg.get("modules_to_save"):
        raise _bad(d, f"modules_to_save {cfg['modules_to_save']} (whole replaced layers) are not supported",
                   ErrorKind.UNSUPPORTED_MODEL)
    alpha = cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _bad(d, f"lora_alpha {alpha!r} is not a number")
    try:
        weight_bytes = (d / WEIGHTS_NAME).read_bytes()
        tensors = load(weight_bytes)
    except Exception as e:  # safetensors raises its own types besides OSError
        raise _bad(d, f"{WEIGHTS_NAME} is not a readable safetensors file: {e}") from None
    digest = hashlib.sha256(hashlib.sha256(config_bytes).digest() + hashlib.sha256(weight_bytes).digest()).digest()
    return cfg, tensors, digest


def _pairs(adapter: Path, tensors: dict) -> dict[str, dict]:
    """module name -> {"A": tensor, "B": tensor, "embedding": bool}."""
    out: dict[str, dict] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise _bad(adapter, f"tensor {key!r} is not a LoRA A or B matrix", ErrorKind.UNSUPPORTED_MODEL)
        part = m["part"]
        entry = out.setdefault(m["module"], {})
        slot = "A" if part.endswith("A") else "B"
        if slot in entry:
            raise _bad(adapter, f"module {m['module']} has two {part} tensors")
        entry[slot] = t
        entry["embedding"] = part.startswith("lora_embedding")
    for module, entry in out.items():
        if "A" not in entry or "B" not in entry:
            raise _bad(adapter, f"module {module} has lora_{'A' if 'A' not in entry else 'B'} missing")
    if not out:
        raise _bad(adapter, f"{WEIGHTS_NAME} holds no LoRA tensors")
    return out


def _target(config, module: str, adapter: Path) -> tuple[str, int, int, bool]:
    """(serving tensor name, first row, row count, delta transposed) that a PEFT module name adapts."""
    c = config
    if module == "lm_head":
        if c.tie_word_embeddings:
            raise _bad(adapter, "targets lm_head, which this model ties to its embeddings", ErrorKind.UNSUPPORTED_MODEL)
        return "lm_head.weight", 0, c.vocab_size, False
    if module == "model.embed_tokens":
        if c.tie_word_embeddings:
            raise _bad(adapter, "targets embed_tokens, which this model ties to its LM head",
                       ErrorKind.UNSUPPORTED_MODEL)
        return "embed.weight", 0, c.vocab_size, True
    if c.kv_lora_rank and ".self_attn." in module:
        raise _bad(adapter, f"module {module!r} is in latent attention, which adapters do not reach here",
                   ErrorKind.UNSUPPORTED_MODEL)
    if c.num_experts and (".mlp." in module or ".block_sparse_moe." in module):
        raise _bad(adapter, f"module {module!r} is in a mixture-of-experts MLP, which adapters do not reach here "
                            "(supported on this model: the q/k/v/o projections, lm_head, embed_tokens)",
                   ErrorKind.UNSUPPORTED_MODEL)
    if c.linear_layers and ".linear_attn." in module:
        raise _bad(adapter, f"module {module!r} is in a Gated DeltaNet layer, which adapters do not reach here",
                   ErrorKind.UNSUPPORTED_MODEL)
    if c.attn_output_gate and module.endswith("self_attn.q_proj"):
        raise _bad(adapter, f"module {module!r} also projects the attention's output gate, which adapters do not "
                            "reach here (k, v, o and the MLP's projections do)", ErrorKind.UNSUPPORTED_MODEL)
    m = _LAYER.match(module)
    if m is None or int(m[1]) >= c.num_layers:
        raise _bad(adapter, f"module {module!r} is not a layer this model has (supported: the q/k/v/o and "
                            f"gate/up/down projections of layers 0..{c.num_layers - 1}, lm_head, embed_tokens)",
                   ErrorKind.UNSUPPORTED_MODEL)
    layer, name = int(m[1]), m[2].split(".")[1]
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    # (Phi-3's and GLM-4's fused qkv_proj and gate_up_proj are our fused rows whole)
    rows = {"q_proj": ("qkv", 0, q), "k_proj": ("qkv", q, kv), "v_proj": ("qkv", q + kv, kv),
            "qkv_proj": ("qkv", 0, q + 2 * kv), "o_proj": ("o", 0, c.hidden_size), "gate_proj": ("gate_up", 0, inter),
            "up_proj": ("gate_up", inter, inter), "gate_up_proj": ("gate_up", 0, 2 * inter),
            "down_proj": ("down", 0, c.hidden_size)}[name]
    return f"layers.{layer}.{rows[0]}.weight", rows[1], rows[2], False


def _terms(adapter: LoraAdapter, config, tensors: dict) -> tuple[list[tuple], bytes]:
    """Every low-rank term of one adapter, checked against the serving tensors: (serving tensor name, first row,
    row count, delta transposed, A, B, factor), the term being factor * B @ A (transposed: its transpose); and
    the adapter's digest (read_adapter)."""
    d = adapter_dir(adapter.path)
    if not math.isfinite(float(adapter.scale)):
        raise _bad(d, f"scale {adapter.scale!r} is not a finite number")
    cfg, raw, digest = read_adapter(d)
    terms = []
    for module, entry in sorted(_pairs(d, raw).items()):
        name, row, count, transposed = _target(config, module, d)
        weight = tensors.get(name)
        if weight is None:
            raise _bad(d, f"targets {module}, but the core has no {name}", ErrorKind.UNSUPPORTED_MODEL)
        A, B = entry["A"], entry["B"]
        if entry["embedding"] != transposed:
            raise _bad(d, f"{module}: {'embedding' if entry['embedding'] else 'linear'} LoRA tensors on a "
                          f"{'embedding' if transposed else 'linear'} layer")
        # linear: A [r, in], B [out, r]; embedding: A [r, vocab], B [hidden, r], delta (B @ A)^T
        out_dim, in_dim = (weight.shape[1], count) if transposed else (count, weight.shape[1])
        rank = A.shape[0]
        if A.dim() != 2 or B.dim() != 2 or B.shape != (out_dim, rank) or A.shape != (rank, in_dim):
            raise _bad(d, f"{module}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} do not fit "
                          f"a [{out_dim}, {in_dim}] layer at rank {rank}")
        if config.rope_interleaved and module.endswith(("q_proj", "k_proj")):  # the rows the loader reordered
            from flared.model.loader import interleaved_rope_rows

            B = interleaved_rope_rows(B, config.num_heads if module.endswith("q_proj") else config.num_kv_heads,
                                      config)
        alpha = _pattern_value(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", cfg.get("r", rank)))
        scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        terms.append((name, row, count, transposed, A, B, float(adapter.scale) * scaling))
    return terms, digest


def merge_adapters(tensors: dict, config, adapters) -> bytes:
    """Every adapter of ``adapters`` (LoraAdapter, in order) added into the serving tensors (flared's names,
    fused qkv and gate_up), in place. Checks everything before changing anything. Returns a digest of the
    adapters and their scales, in order: what the merged weights depend on."""
    terms: list[tuple] = []
    h = hashlib.sha256()
    for a in adapters:
        adapter_terms, digest = _terms(a, config, tensors)
        terms += adapter_terms
        h.update(digest + repr(float(a.scale)).encode())
    merged: dict = {}
    for name, row, count, transposed, A, B, factor in terms:
        if name not in merged:
            merged[name] = tensors[name].float().clone()
        delta = (B.float() @ A.float()) * factor
        merged[name][row:row + count] += delta.t() if transposed else delta
    for name, value in merged.items():
        tensors[name] = value.to(tensors[name].dtype).contiguous()
    return h.digest()


def lora_factors(adapter: LoraAdapter, config, tensors: dict) -> tuple[dict, bytes]:
    """One adapter kept apart from the weights, for requests that name it (DecoderModel.add_lora_module):
    serving tensor name -> [(first row, row count, A [r, in], B [count, r] * factor)], float32, and the
    adapter's digest. Only the layers' products: an LM head or embedding term is refused (merge such adapters
    with --lora)."""
    out: dict = {}
    terms, digest = _terms(adapter, config, tensors)
    for name, row, count, transposed, A, B, factor in terms:
        if not name.startswith("layers."):
            raise _bad(adapter_dir(adapter.path), f"a per-request adapter may target the layers' projections only, "
                       f"not {name.removesuffix('.weight')} (merge it into the weights with --lora)",
                       ErrorKind.UNSUPPORTED_MODEL)
        out.setdefault(name, []).append((row, count, A.float(), B.float() * factor))
    return out, digest
