"""The prepared core's manifest: its schema, its validation, its hashing.

A core is a directory; ``manifest.json`` says what it holds and how it may be
served. Rules:

- The manifest is validated completely (every field, its type and range, the
  format version, the model config, every asset's presence and SHA-256) before
  anything is allocated for serving. Any problem is a ``CoreError`` that names
  the file and the field.
- Unknown top-level fields are errors: a core written by a newer flared must
  not be half-understood by an older one (bump ``format_version`` instead).
- Assets are addressed by relative file names inside the core; a name that
  escapes the directory is rejected.

docs/core-format.md is the prose version of this module.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from flared.errors import CoreError, ErrorKind

FORMAT_NAME = "flared-core"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
HASH_CHUNK_BYTES = 8 << 20


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Asset:
    sha256: str  # hex digest of the file's bytes
    size_bytes: int


@dataclasses.dataclass(frozen=True)
class TokenSpec:
    """Token settings the frontend and the stop logic need."""

    bos_token: str | None
    bos_token_id: int | None
    eos_token: str | None
    eos_token_ids: tuple[int, ...]  # any of these ends generation
    pad_token_id: int | None
    add_bos_token: bool  # prepend BOS when encoding a raw prompt


@dataclasses.dataclass(frozen=True)
class Capacities:
    context_tokens: int  # prompt + output limit of one request
    page_tokens: int  # KV page size in tokens
    concurrency: int  # live request slots
    prefill_chunk_tokens: int  # largest prefill graph, 64-aligned
    kv_pages: int  # KV pages in the pool
    decode_batch_sizes: tuple[int, ...]  # captured decode graph batch capacities
    prefill_token_sizes: tuple[int, ...]  # captured prefill graph token capacities


@dataclasses.dataclass(frozen=True)
class Manifest:
    checkpoint_id: str  # stable id of this core (also the fallback model name)
    created_by: str  # "flared <version>"
    source: dict[str, Any]  # kind ("hf" | "gguf"), name, sha256 of the source file(s)
    architecture: str
    model: dict[str, Any]  # ModelConfig.to_dict()
    dtype: str  # "float32" | "bfloat16" | "float16"
    capacities: Capacities
    served_names: tuple[str, ...]
    capabilities: dict[str, bool]
    context_hint: str  # names the setting that raises the context limit
    capacity_hint: str  # names the setting that raises concurrency
    tokens: TokenSpec
    generation_defaults: dict[str, Any]  # sampling defaults a request may override
    weights: tuple[str, ...]  # safetensors files, in load order
    tokenizer: str  # tokenizer.json file name
    chat_template: str | None  # template file name, None if the model has none
    assets: dict[str, Asset]  # every file above -> its hash and size
    # A vision-language core's image side: {"config": VisionConfig.to_dict(), "processor": TileProcessor.to_dict(),
    # "weights": the tower's safetensors file}, and maybe "video" (a video processor's dict) and "audio" (a second
    # tower's {"config", "processor"}: Gemma 4's audio, its tensors "audio."-prefixed in the same file); None for a
    # text-only model.
    vision: dict[str, Any] | None = None
    # A core whose layer matrices are stored quantised (flarectl export --quantization): the plan that chose each
    # one's format, {"default": "q4_1" | "q8_0", "matrices": {name: format or null}, "grids": bool}; None: plain.
    weights_quantization: dict[str, Any] | None = None

    @property
    def model_name(self) -> str:
        for name in self.served_names:
            if name:
                return name
        return self.checkpoint_id

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **d}
        return json.dumps(d, indent=2, sort_keys=False) + "\n"


DTYPES = ("float32", "bfloat16", "float16")
_TOP_LEVEL = {f.name for f in dataclasses.fields(Manifest)} | {"format", "format_version"}


class _Reader:
    """Typed field access that names the file and the field on every error."""

    def __init__(self, path: Path, data: Any, where: str = ""):
        self.path, self.data, self.where = path, data, where

    def fail(self, msg: str) -> CoreError:
        return CoreError(f"{self.path}: {msg}", ErrorKind.CORE_FORMAT)

    def field(self, name: str, types: type | tuple[type, ...], *, optional: bool = False) -> Any:
        full = f"{self.where}{name}"
        if not isinstance(self.data, dict):
            raise self.fail(f"{self.where.rstrip('.') or 'manifest'} must be an object")
        if name not in self.data:
            if optional:
                return None
            raise self.fail(f"missing field {full!r}")
        v = self.data[name]
        if v is None and optional:
            return None
        # bool is an int subclass; never accept it where a number is wanted
        if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            raise self.fail(f"field {full!r} must be {_type_names(types)}, got a boolean")
        if not isinstance(v, types):
            raise self.fail(f"field {full!r} must be {_type_names(types)}, got {type(v).__name__}")
        return v

    def positive_int(self, name: str) -> int:
        v = self.field(name, int)
        if v <= 0:
            raise self.fail(f"field {self.where}{name!r} must be positive, got {v}")
        return v

    def int_list(self, name: str) -> tuple[int, ...]:
        v = self.field(name, list)
        if not v or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v):
            raise self.fail(f"field {self.where}{name!r} must be a non-empty list of positive integers")
        if list(v) != sorted(set(v)):
            raise self.fail(f"field {self.where}{name!r} must be sorted and without repeats")
        return tuple(v)

    def sub(self, name: str) -> "_Reader":
        return _Reader(self.path, self.field(name, dict), f"{self.where}{name}.")


def _type_names(types) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join({str: "a string", int: "an integer", float: "a number", bool: "a boolean",
                        list: "a list", dict: "an object"}.get(t, t.__name__) for t in ts)


def parse_manifest(path: Path, data: Any) -> Manifest:
    """Validate a decoded manifest.json; raise CoreError naming the field."""
    r = _Reader(path, data)
    if not isinstance(data, dict):
        raise r.fail("manifest must be a JSON object")
    if r.field("format", str) != FORMAT_NAME:
        raise r.fail(f"field 'format' must be {FORMAT_NAME!r}, got {data['format']!r}")
    version = r.field("format_version", int)
    if version != FORMAT_VERSION:
        raise r.fail(f"format_version {version} is not supported (this flared reads {FORMAT_VERSION})")
    unknown = sorted(set(data) - _TOP_LEVEL)
    if unknown:
        raise r.fail(f"unknown field(s) {', '.join(map(repr, unknown))}")

    c = r.sub("capacities")
    caps = Capacities(
        context_tokens=c.positive_int("context_tokens"),
        page_tokens=c.positive_int("page_tokens"),
        concurrency=c.positive_int("concurrency"),
        prefill_chunk_tokens=c.positive_int("prefill_chunk_tokens"),
        kv_pages=c.positive_int("kv_pages"),
        decode_batch_sizes=c.int_list("decode_batch_sizes"),
        prefill_token_sizes=c.int_list("prefill_token_sizes"),
    )
    if caps.prefill_chunk_tokens % 64 or caps.prefill_chunk_tokens > caps.context_tokens:
        raise c.fail("capacities.prefill_chunk_tokens must be a multiple of 64 within context_tokens")
    if caps.decode_batch_sizes[-1] < caps.concurrency:
        raise c.fail("capacities.decode_batch_sizes must cover the concurrency")
    if caps.prefill_token_sizes[-1] != caps.prefill_chunk_tokens:
        raise c.fail("capacities.prefill_token_sizes must end at prefill_chunk_tokens")

    t = r.sub("tokens")
    eos = t.field("eos_token_ids", list)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in eos):
        raise t.fail("field 'tokens.eos_token_ids' must be a list of non-negative integers")
    tokens = TokenSpec(
        bos_token=t.field("bos_token", str, optional=True),
        bos_token_id=t.field("bos_token_id", int, optional=True),
        eos_token=t.field("eos_token", str, optional=True),
        eos_token_ids=tuple(eos),
        pad_token_id=t.field("pad_token_id", int, optional=True),
        add_bos_token=t.field("add_bos_token", bool),
    )

    a = r.sub("assets")
    assets = {}
    for name in a.data:
        _check_asset_name(r, name)
        entry = a.sub(name)
        digest = entry.field("sha256", str)
        if len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest):
            raise entry.fail(f"field 'assets.{name}.sha256' is not a SHA-256 hex digest")
        size = entry.field("size_bytes", int)
        if size < 0:
            raise entry.fail(f"field 'assets.{name}.size_bytes' must not be negative")
        assets[name] = Asset(sha256=digest, size_bytes=size)

    weights = tuple(r.field("weights", list))
    if not weights or not all(isinstance(w, str) for w in weights):
        raise r.fail("field 'weights' must be a non-empty list of file names")
    tokenizer = r.field("tokenizer", str)
    chat_template = r.field("chat_template", str, optional=True)
    for name in (*weights, tokenizer, *([chat_template] if chat_template else [])):
        _check_asset_name(r, name)
        if name not in assets:
            raise r.fail(f"file {name!r} is not listed in 'assets'")

    dtype = r.field("dtype", str)
    if dtype not in DTYPES:
        raise r.fail(f"field 'dtype' must be one of {', '.join(DTYPES)}, got {dtype!r}")
    served = r.field("served_names", list)
    if not all(isinstance(s, str) for s in served):
        raise r.fail("field 'served_names' must be a list of strings")
    capabilities = r.field("capabilities", dict)
    if not all(isinstance(v, bool) for v in capabilities.values()):
        raise r.fail("field 'capabilities' must map names to booleans")

    vision = r.field("vision", dict, optional=True)
    if vision is not None:
        if not {"config", "processor", "weights"} <= set(vision) <= {"config", "processor", "weights", "video",
                                                                     "audio"}:
            raise r.fail("field 'vision' must hold 'config', 'processor' and 'weights' (and maybe 'video', 'audio')")
        if not isinstance(vision.get("video", {}), dict):
            raise r.fail("field 'vision.video' must be an object")
        audio = vision.get("audio", {"config": {}, "processor": {}})
        if not isinstance(audio, dict) or set(audio) != {"config", "processor"} or not all(
                isinstance(audio[k], dict) for k in audio):
            raise r.fail("field 'vision.audio' must be an object of 'config' and 'processor' objects")
        if not isinstance(vision["config"], dict) or not isinstance(vision["processor"], dict):
            raise r.fail("fields 'vision.config' and 'vision.processor' must be objects")
        if not isinstance(vision["weights"], str):
            raise r.fail("field 'vision.weights' must be a file name")
        _check_asset_name(r, vision["weights"])
        if vision["weights"] not in assets:
            raise r.fail(f"file {vision['weights']!r} is not listed in 'assets'")

    stored = r.field("weights_quantization", dict, optional=True)
    if stored is not None:
        formats = ("q8_0", "q4_1")
        matrices = stored.get("matrices", {})
        if set(stored) - {"default", "matrices", "grids"} or stored.get("default") not in formats or \
                not isinstance(matrices, dict) or not all(isinstance(k, str) and v in (*formats, None)
                                                          for k, v in matrices.items()) or \
                not isinstance(stored.get("grids", False), bool):
            raise r.fail("field 'weights_quantization' must be {'default': 'q8_0' or 'q4_1', 'matrices': {name: "
                         "format or null}, 'grids': bool}")
        if dtype != "bfloat16":
            raise r.fail("field 'weights_quantization' needs a bfloat16 core")

    m = Manifest(
        checkpoint_id=r.field("checkpoint_id", str),
        created_by=r.field("created_by", str),
        source=r.field("source", dict),
        architecture=r.field("architecture", str),
        model=r.field("model", dict),
        dtype=dtype,
        capacities=caps,
        served_names=tuple(served),
        capabilities=dict(capabilities),
        context_hint=r.field("context_hint", str),
        capacity_hint=r.field("capacity_hint", str),
        tokens=tokens,
        generation_defaults=r.field("generation_defaults", dict),
        weights=weights,
        tokenizer=tokenizer,
        chat_template=chat_template,
        assets=assets,
        vision=vision,
        weights_quantization=stored,
    )
    if not m.checkpoint_id:
        raise r.fail("field 'checkpoint_id' must not be empty")
    if m.model.get("architecture") != m.architecture:
        raise r.fail("field 'architecture' disagrees with 'model.architecture'")
    return m


def _check_asset_name(r: _Reader, name: str) -> None:
    if not name or "/" in name or "\\" in name or name in (".", "..") or name == MANIFEST_NAME:
        raise r.fail(f"asset name {name!r} must be a plain file name inside the core")


def read_manifest(core_dir: str | os.PathLike) -> Manifest:
    """Read and validate ``CORE/manifest.json`` (no asset hashing)."""
    path = Path(core_dir) / MANIFEST_NAME
    if not Path(core_dir).is_dir():
        raise CoreError(f"{core_dir}: not a core directory", ErrorKind.CORE_MISSING)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CoreError(f"{path}: missing (is {core_dir} a core made by 'flarectl export'?)",
                        ErrorKind.CORE_MISSING) from None
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CoreError(f"{path}: not valid JSON: {e}", ErrorKind.CORE_FORMAT) from None
    return parse_manifest(path, data)


def verify_assets(core_dir: str | os.PathLike, manifest: Manifest) -> None:
    """Check every asset's size and SHA-256; the first mismatch (in the manifest's order) names the file. The files
    are hashed side by side, one a thread (hashlib lets go of the GIL), so a core of several shards (an 8B bf16
    core has four) hashes on several cores: four 640 MiB files took 1.26 s on two threads against 2.26 s on one."""
    paths = []
    for name, asset in manifest.assets.items():
        path = Path(core_dir) / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CoreError(f"{path}: asset listed in the manifest is missing", ErrorKind.CORE_MISSING) from None
        if size != asset.size_bytes:
            raise CoreError(f"{path}: size {size} bytes, manifest says {asset.size_bytes}", ErrorKind.CORE_HASH)
        paths.append((path, asset))
    workers = min(len(paths), os.cpu_count() or 1)
    if workers > 1:
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="flared-hash") as pool:
            digests = list(pool.map(sha256_file, [path for path, _ in paths]))
    else:
        digests = [sha256_file(path) for path, _ in paths]
    for (path, asset), digest in zip(paths, digests):
        if digest != asset.sha256:
            raise CoreError(f"{path}: SHA-256 {digest} does not match the manifest's {asset.sha256}",
                            ErrorKind.CORE_HASH)
