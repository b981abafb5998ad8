"""Export ("ignition"): turn a Hugging Face directory or a GGUF file into a core.

Rules:
- The export writes into a private staging directory beside the destination
  and renames it into place only when every file is written, hashed and
  synced: a failed export (bad source, full disk, Ctrl-C) leaves no core and
  no partial directory behind.
- Everything a server needs at load time is decided here and recorded in the
  manifest: capacities, token settings, generation defaults, served names.
- `flarectl export` runs this in its own process; serving never imports a
  source format.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from flared import __version__
from flared.core.manifest import (
    DTYPES,
    MANIFEST_NAME,
    Asset,
    Capacities,
    Manifest,
    TokenSpec,
    sha256_file,
)
from flared.errors import CoreError, ErrorKind

# Why these defaults: 64-token pages match the prefix cache's hash blocks; 32
# live requests is where a CPU stops gaining aggregate throughput; 512-token
# prefill chunks keep a decode step from waiting long behind a prompt.
DEFAULT_PAGE_TOKENS = 64
DEFAULT_CONCURRENCY = 32
DEFAULT_PREFILL_CHUNK_TOKENS = 512
DEFAULT_MAX_CONTEXT_TOKENS = 8192
DEFAULT_KV_CACHE_MIB = 2048
WEIGHT_SHARD_BYTES = 4 << 30
VISION_WEIGHTS = "vision.safetensors"
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    dtype: str = "float32"
    context_tokens: int | None = None  # None: the model's own limit, capped at DEFAULT_MAX_CONTEXT_TOKENS
    concurrency: int = DEFAULT_CONCURRENCY
    page_tokens: int = DEFAULT_PAGE_TOKENS
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    kv_cache_mib: int = DEFAULT_KV_CACHE_MIB
    served_names: tuple[str, ...] = ()
    # "q8_0", "q4_1" or "gguf": the layer matrices stored quantised in the kernels' layout (quant.pack_layer_matrices)
    quantization: str | None = None
    # llama.cpp's image tower (an mmproj GGUF) for a GGUF model: flared.model.mmproj
    mmproj: str | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise CoreError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}", ErrorKind.VALIDATION)
        if self.quantization is not None and (self.quantization not in ("q8_0", "q4_1", "gguf")
                                              or self.dtype != "bfloat16"):
            raise CoreError(f"--quantization {self.quantization}: a core stores its matrices as q8_0, q4_1 or gguf "
                            "(each at about its GGUF tensors' bits) over bfloat16 (--dtype bfloat16)",
                            ErrorKind.VALIDATION)
        for name in ("concurrency", "page_tokens", "prefill_chunk_tokens", "kv_cache_mib"):
            if getattr(self, name) <= 0:
                raise CoreError(f"{name} must be positive", ErrorKind.VALIDATION)
        if self.context_tokens is not None and self.context_tokens <= 0:
            raise CoreError("context must be positive", ErrorKind.VALIDATION)
        if self.concurrency > 64:
            raise CoreError("concurrency is at most 64 live requests", ErrorKind.VALIDATION)
        if self.prefill_chunk_tokens % 64:
            raise CoreError("prefill chunk must be a multiple of 64 tokens", ErrorKind.VALIDATION)


@dataclasses.dataclass
class _Assets:
    tokenizer_json: str
    chat_template: str | None
    tokens: TokenSpec
    generation_defaults: dict[str, Any]
    tokenizer: Any = dataclasses.field(default=None, repr=False, compare=False)  # (tokenizer_json, parsed once)


def export_core(source: str | os.PathLike, out: str | os.PathLike, options: ExportOptions = ExportOptions(),
                *, force: bool = False) -> Manifest:
    """Export ``source`` to a core at ``out``; returns the written manifest."""
    source, out = Path(source), Path(out)
    if out.exists() and not force:
        raise CoreError(f"{out}: already exists (pass --force to replace it)", ErrorKind.VALIDATION)
    if not source.exists():
        raise CoreError(f"{source}: no such file or directory", ErrorKind.CORE_MISSING)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        manifest = _export_into(source, staging, options)
        _set_public_modes(staging)
        _fsync_dir_files(staging)
        _replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _export_into(source: Path, staging: Path, options: ExportOptions) -> Manifest:
    # Imported here: only export needs torch-side source readers.
    import torch
    from safetensors.torch import save_file

    from flared.model.loader import read_source

    dtype = getattr(torch, options.dtype)
    # (quantized sources dequantized straight to the core's dtype)
    src = read_source(source, dtype=dtype, mmproj=options.mmproj)
    assets = _read_gguf_assets(source) if src.source_kind == "gguf" else _read_hf_assets(source)
    config = src.config
    caps = _capacities(config, options)

    source_info = _source_info(source, src.source_kind)
    if options.mmproj is not None:  # (the image tower's file, read beside the model's)
        source_info["mmproj"] = {"name": Path(options.mmproj).name, "sha256": sha256_file(Path(options.mmproj))}
    if src.quantization is not None:  # (a GPTQ, AWQ, compressed-tensors or fp8 checkpoint, dequantised at read)
        source_info["quantization"] = src.quantization.describe()
    plan = _stored_plan(options.quantization, source_info)
    # Norms kept in float32 (a few kilobytes) where the family scales in float32 (ModelConfig.float_norms: Gemma's
    # 1 + w, gpt-oss', Cohere's)
    float_norms = config.float_norms
    weight_files = []
    shard: dict[str, Any] = {}
    shard_bytes = 0
    for name in sorted(src.tensors):
        t = src.tensors.pop(name)  # pop: keep peak memory at one copy of the model
        if t.is_floating_point():
            # (DeepSeek-V3-style routers stay float32, as transformers keeps them)
            keep = (float_norms and name.endswith("norm.weight")) or (config.router_float32 and ".router." in name)
            t = t.to(torch.float32 if keep else dtype)
        parts = {name: t.contiguous()}
        if plan is not None:  # (a layer matrix the plan keeps quantised: its kernels' tensors in its place)
            from flared.model.quant import pack_layer_matrices

            parts = pack_layer_matrices(parts, plan)
        for key, part in parts.items():
            nbytes = part.numel() * part.element_size()
            if shard and shard_bytes + nbytes > WEIGHT_SHARD_BYTES:
                weight_files.append(_write_shard(save_file, staging, len(weight_files), shard))
                shard, shard_bytes = {}, 0
            shard[key] = part.contiguous()
            shard_bytes += nbytes
    weight_files.append(_write_shard(save_file, staging, len(weight_files), shard))
    del shard
    vision = None
    if src.vision is not None:
        processor = _read_image_processor(source, src.vision, src.image_processor,
                                          Path(options.mmproj) if options.mmproj else None)
        audio = _read_second_audio(source, src, assets)
        vision_tensors = {k: (t.to(dtype) if t.is_floating_point() else t).contiguous()
                          for k, t in src.vision_tensors.items()}
        if audio is not None:  # (Gemma 4's audio tower, in the same file: its tensors "audio."-prefixed)
            vision_tensors.update({"audio." + k: (t.to(dtype) if t.is_floating_point() else t).contiguous()
                                   for k, t in src.audio_tensors.items()})
        save_file(vision_tensors, str(staging / VISION_WEIGHTS),
                  metadata={"format": "pt", "producer": f"flared {__version__}"})
        del vision_tensors
        weight_files_extra = [VISION_WEIGHTS]
        vision = {"config": src.vision.to_dict(), "processor": processor.to_dict(), "weights": VISION_WEIGHTS}
        if audio is not None:
            vision["audio"] = {"config": src.audio.to_dict(), "processor": audio.to_dict()}
        if getattr(processor, "modality", "image") == "audio":  # (its audio token, as the tokenizer spells it)
            found = assets.tokenizer.token_to_id(processor.audio_token)
            if found != src.vision.image_token_id:
                raise CoreError(f"{source}: the tokenizer's {processor.audio_token} is token {found}, but the config's "
                                f"audio token is {src.vision.image_token_id}", ErrorKind.SOURCE_FORMAT)
            if processor.kind == "qwen3_asr" and any(assets.tokenizer.token_to_id(t) is None
                                                     for t in (processor.start_token, processor.end_token)):
                processor = dataclasses.replace(processor, start_token="", end_token="")  # (none to put around it)
                vision["processor"] = processor.to_dict()
        if processor.kind == "pooled_patches":  # (Gemma 4: its image token and the tokens around an image)
            tokenizer = assets.tokenizer
            found = tokenizer.token_to_id(processor.image_token)
            if found != src.vision.image_token_id:
                raise CoreError(f"{source}: the tokenizer's {processor.image_token} is token {found}, but the config's "
                                f"image token is {src.vision.image_token_id}", ErrorKind.SOURCE_FORMAT)
            missing = [t for t in (processor.boi_token, processor.eoi_token) if tokenizer.token_to_id(t) is None]
            if missing:
                raise CoreError(f"{source}: the tokenizer has no {' or '.join(missing)} token", ErrorKind.SOURCE_FORMAT)
        if processor.kind == "llama4_tiles":  # (Llama 4: its patch token is the image token; the rest exist)
            tokenizer = assets.tokenizer
            found = tokenizer.token_to_id(processor.patch_token)
            if found != src.vision.image_token_id:
                raise CoreError(f"{source}: the tokenizer's {processor.patch_token} is token {found}, but the config's "
                                f"image token is {src.vision.image_token_id}", ErrorKind.SOURCE_FORMAT)
            missing = [t for t in (processor.image_token, processor.start_token, processor.end_token,
                                   processor.tile_x_token, processor.tile_y_token) if tokenizer.token_to_id(t) is None]
            if missing:
                raise CoreError(f"{source}: the tokenizer has no {' or '.join(missing)} token", ErrorKind.SOURCE_FORMAT)
        video = (_read_video_processor(source, src.vision, assets, processor) if options.mmproj is None
                 else None)
        if video is not None:
            vision["video"] = video.to_dict()
    else:
        weight_files_extra = []

    (staging / "tokenizer.json").write_text(assets.tokenizer_json, encoding="utf-8")
    files = [*weight_files, *weight_files_extra, "tokenizer.json"]
    if assets.chat_template is not None:
        (staging / "chat_template.jinja").write_text(assets.chat_template, encoding="utf-8")
        files.append("chat_template.jinja")

    identity = hashlib.sha256(json.dumps([source_info, options.dtype, caps.page_tokens], sort_keys=True).encode())
    slug = _slug(source.stem if source.is_file() else source.name)
    checkpoint_id = f"{slug}-{identity.hexdigest()[:12]}"
    served = tuple(options.served_names) or (slug,)
    template = assets.chat_template or ""
    manifest = Manifest(
        checkpoint_id=checkpoint_id,
        created_by=f"flared {__version__}",
        source=source_info,
        architecture=config.architecture,
        model=config.to_dict(),
        dtype=options.dtype,
        capacities=caps,
        served_names=served,
        capabilities={
            "chat": assets.chat_template is not None,
            "completions": True,
            "logprobs": True,
            "tools": "tools" in template,
            "reasoning": "<think>" in template or "enable_thinking" in template,
            "vision": vision is not None and not src.vision.is_audio,
            "audio": vision is not None and src.vision.is_audio,
            "video": vision is not None and "video" in vision,
        },
        context_hint="raise the context limit with 'flarectl export --context N' (up to the model's own limit)",
        capacity_hint="raise live requests with 'flarectl export --concurrency N' (at most 64)",
        tokens=assets.tokens,
        generation_defaults=assets.generation_defaults,
        weights=tuple(weight_files),
        tokenizer="tokenizer.json",
        chat_template="chat_template.jinja" if assets.chat_template is not None else None,
        assets={f: Asset(sha256=sha256_file(staging / f), size_bytes=(staging / f).stat().st_size) for f in files},
        vision=vision,
        weights_quantization=plan.to_dict() if plan is not None else None,
    )
    (staging / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
    return manifest


def _stored_plan(quantization: str | None, source_info: dict):
    """The QuantPlan a core's layer matrices are stored by (--quantization: q8_0 or q4_1 as the runtime keeps them
    over this source, gguf each at about its GGUF tensors' bits); None: stored plain."""
    if quantization is None:
        return None
    from flared.model.quant import QuantPlan, resolve_quantization

    try:
        plan = resolve_quantization(quantization, source_info)
    except ValueError as exc:
        raise CoreError(f"--quantization {quantization}: {exc}", ErrorKind.VALIDATION) from None
    return plan if isinstance(plan, QuantPlan) or plan is None else QuantPlan(plan)


def _write_shard(save_file, staging: Path, index: int, tensors: dict) -> str:
    name = f"weights-{index:05d}.safetensors"
    save_file(tensors, str(staging / name), metadata={"format": "pt", "producer": f"flared {__version__}"})
    return name


def _capacities(config, options: ExportOptions) -> Capacities:
    model_limit = int(config.max_position_embeddings)
    if options.context_tokens is None:
        context = min(model_limit, DEFAULT_MAX_CONTEXT_TOKENS)
    else:
        context = options.context_tokens
        if context > model_limit:
            raise CoreError(f"--context {context} exceeds the model's limit of {model_limit} tokens",
                            ErrorKind.VALIDATION)
    if context < 64:
        raise CoreError("context must be at least 64 tokens", ErrorKind.VALIDATION)
    chunk = min(options.prefill_chunk_tokens, context - context % 64)
    page = options.page_tokens
    # Bytes of K and V for one page across the layers that keep them (not Gated DeltaNet's), at the serving dtype.
    elem_bytes = 4 if options.dtype == "float32" else 2
    page_bytes = config.kv_values_per_token * page * elem_bytes
    pages_per_request = math.ceil(context / page)
    # (a model with no attention at all keeps no keys or values: its pages only count tokens)
    budget_pages = (options.kv_cache_mib << 20) // page_bytes if page_bytes else options.concurrency * pages_per_request
    kv_pages = min(options.concurrency * pages_per_request, budget_pages)
    if kv_pages < pages_per_request:
        raise CoreError(
            f"a {options.kv_cache_mib} MiB KV cache holds {budget_pages} pages of {page} tokens, fewer than one "
            f"full-context request needs ({pages_per_request}); raise --kv-cache-mib or lower --context",
            ErrorKind.VALIDATION)
    decode_sizes = []
    b = 1
    while True:
        decode_sizes.append(b)
        if b >= options.concurrency:
            break
        b *= 2
    prefill_sizes = []
    t = 64
    while t < chunk:
        prefill_sizes.append(t)
        t *= 2
    prefill_sizes.append(chunk)
    return Capacities(
        context_tokens=context,
        page_tokens=page,
        concurrency=options.concurrency,
        prefill_chunk_tokens=chunk,
        kv_pages=int(kv_pages),
        decode_batch_sizes=tuple(decode_sizes),
        prefill_token_sizes=tuple(sorted(set(prefill_sizes))),
    )


# -- tokenizer, template and token settings -------------------------------------------------------

def _read_hf_assets(src: Path) -> _Assets:
    tok_path = src / "tokenizer.json"
    tekken = src / "tekken.json"  # (Mistral's own format, where a checkpoint ships no tokenizer.json)
    if tok_path.is_file():
        tokenizer_json = tok_path.read_text(encoding="utf-8")
    elif tekken.is_file():
        from flared.frontend.tekken import tekken_tokenizer_json

        tokenizer_json, tok_path = tekken_tokenizer_json(tekken), tekken
    else:
        raise CoreError(f"{tok_path}: missing (flared needs a fast tokenizer's tokenizer.json, or Mistral's "
                        "tekken.json)", ErrorKind.SOURCE_FORMAT)
    tcfg = _read_json(src / "tokenizer_config.json", required=False) or {}
    if tok_path == tekken:  # (its control tokens are mistral-common's <s> and </s>)
        from flared.frontend.tekken import BOS, EOS

        tcfg = {"bos_token": BOS, "eos_token": EOS, **tcfg}
    gcfg = _read_json(src / "generation_config.json", required=False) or {}

    template = None
    if (src / "chat_template.jinja").is_file():
        template = (src / "chat_template.jinja").read_text(encoding="utf-8")
    elif (src / "chat_template.json").is_file():
        template = (_read_json(src / "chat_template.json") or {}).get("chat_template")
    if template is None:
        template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise CoreError(f"{src / 'tokenizer_config.json'}: chat_template must be a string", ErrorKind.SOURCE_FORMAT)

    bos = _token_text(tcfg.get("bos_token"))
    eos = _token_text(tcfg.get("eos_token"))
    return _assets_from(tokenizer_json, template, bos, eos, gcfg.get("eos_token_id"), tcfg.get("pad_token"),
                        gcfg, where=tok_path)


# the image processor kind (flared.frontend.images) each vision family's checkpoints ship
_PROCESSOR_KINDS = {"idefics3": "tiles", "qwen2_vl": "patches", "qwen2_5_vl": "patches", "qwen3_vl": "patches",
                    "pixtral": "pixtral", "llava": "crop", "gemma3": "square", "internvl": "canvas",
                    "llava_next": "anyres", "llava_onevision": "anyres", "qwen2_audio": "whisper",
                    "audioflamingo3": "whisper", "glmasr": "whisper", "gemma4": "pooled_patches",
                    "qwen3_asr": "qwen3_asr", "llama4": "llama4_tiles"}


def _read_image_processor(src: Path, vision, given: tuple[dict, dict] | None = None, mmproj: Path | None = None):
    """The image processor a vision checkpoint's preprocessor_config.json (and processor_config.json) describe, or
    ``given`` (an mmproj's, as those files would say it), checked against the tower it feeds."""
    from flared.errors import FrontendError
    from flared.frontend.images import image_processor_from_hf

    if given is not None:
        pre, proc = given
        where = where_proc = mmproj
    else:
        pre = _read_json(src / "preprocessor_config.json", required=False)
        proc = _read_json(src / "processor_config.json", required=False)
        where, where_proc = src / "preprocessor_config.json", src / "processor_config.json"
        nested = proc.get("image_processor") if isinstance(proc, dict) else None
        extractor = proc.get("feature_extractor") if isinstance(proc, dict) else None
        if vision.is_audio and pre is None and isinstance(extractor, dict):
            # (transformers 5 saves an audio model's feature extractor nested in processor_config.json)
            pre, where = extractor, where_proc
        elif not vision.is_audio and isinstance(nested, dict) and (
                pre is None or (isinstance(pre, dict) and "feature_extractor_type" in pre
                                and "image_processor_type" not in pre)):
            # (transformers 5 saves a processor's parts nested in processor_config.json; a preprocessor_config.json
            # beside it may hold an audio feature extractor's settings, not the images')
            pre, where = {}, where_proc
        elif pre is None:
            raise CoreError(f"{where}: missing (and processor_config.json has no \"image_processor\" or "
                            "\"feature_extractor\")", ErrorKind.SOURCE_FORMAT)
    if not isinstance(pre, dict) or (proc is not None and not isinstance(proc, dict)):
        raise CoreError(f"{src}: preprocessor_config.json and processor_config.json must be JSON objects",
                        ErrorKind.SOURCE_FORMAT)
    kind = _PROCESSOR_KINDS[vision.family]
    if kind == "whisper":
        return _read_audio_processor(pre, proc, vision, where)
    if kind == "qwen3_asr":
        return _read_qwen3_asr_processor(pre, proc, vision, where)
    fixed = kind in ("tiles", "crop", "square", "canvas", "anyres")  # a fixed number of image tokens per tile
    declared = (proc or {}).get("image_seq_len")
    if kind == "tiles" and declared is not None and declared != vision.image_seq_len:
        raise CoreError(f"{where_proc}: image_seq_len {declared} disagrees with the vision tower's "
                        f"{vision.image_seq_len} rows per tile", ErrorKind.SOURCE_FORMAT)
    try:
        processor = image_processor_from_hf(pre, proc, image_seq_len=vision.image_seq_len if fixed else None)
    except FrontendError as e:
        raise CoreError(f"{where}: {e}", ErrorKind.SOURCE_FORMAT) from None
    if processor.kind != kind:
        raise CoreError(f"{where}: its image processor ({processor.kind}) does not fit a "
                        f"{vision.family} tower", ErrorKind.UNSUPPORTED_MODEL)
    if kind == "tiles" and processor.tile != vision.image_size:
        raise CoreError(f"{where}: tiles of {processor.tile} pixels, but the vision tower "
                        f"takes {vision.image_size}", ErrorKind.UNSUPPORTED_MODEL)
    if kind in ("square", "canvas") and (processor.height, processor.width) != (vision.image_size, vision.image_size):
        raise CoreError(f"{where}: images resized to {processor.width}x{processor.height} pixels, but the vision "
                        f"tower takes {vision.image_size} square", ErrorKind.UNSUPPORTED_MODEL)
    if kind == "anyres" and (processor.tile, processor.grid_pinpoints) != (vision.image_size, vision.grid_pinpoints):
        raise CoreError(f"{where}: tiles of {processor.tile} pixels on canvases {list(processor.grid_pinpoints)}, but "
                        f"the model takes {vision.image_size} on {list(vision.grid_pinpoints)} (config.json's "
                        "image_grid_pinpoints)", ErrorKind.UNSUPPORTED_MODEL)
    if kind == "anyres" and (processor.anyres_max, processor.multi_image) != (
            vision.anyres_max, vision.family == "llava_onevision"):
        raise CoreError(f"{where}: an image processor for {'LLaVA-OneVision' if processor.multi_image else 'LLaVA-NeXT'}"
                        f" (anyres_max {processor.anyres_max}) does not fit a {vision.family} model (anyres_max "
                        f"{vision.anyres_max})", ErrorKind.UNSUPPORTED_MODEL)
    if kind == "crop" and (processor.crop_height, processor.crop_width) != (vision.image_size, vision.image_size):
        raise CoreError(f"{where}: crops of {processor.crop_width}x{processor.crop_height} "
                        f"pixels, but the vision tower takes {vision.image_size} square", ErrorKind.UNSUPPORTED_MODEL)
    if kind == "llama4_tiles":
        if (processor.tile, processor.tokens_per_tile) != (vision.image_size, vision.image_seq_len):
            raise CoreError(f"{where}: tiles of {processor.tile} pixels making {processor.tokens_per_tile} tokens, "
                            f"but the vision tower takes {vision.image_size} and makes {vision.image_seq_len}",
                            ErrorKind.UNSUPPORTED_MODEL)
        return processor
    if kind == "pooled_patches":
        if (processor.patch_size, processor.pooling_kernel_size) != (vision.patch_size, vision.scale_factor):
            raise CoreError(f"{where}: patches of {processor.patch_size} pixels pooled {processor.pooling_kernel_size}"
                            f" x {processor.pooling_kernel_size}, but the vision tower takes {vision.patch_size} and "
                            f"{vision.scale_factor}", ErrorKind.UNSUPPORTED_MODEL)
        return processor
    if not fixed and (processor.patch_size, processor.merge_size, getattr(processor, "temporal_patch_size", 0)) != (
            vision.patch_size, vision.scale_factor, vision.temporal_patch_size):
        raise CoreError(f"{where}: patches of {processor.patch_size} pixels merged "
                        f"{processor.merge_size} x {processor.merge_size}, but the vision tower takes "
                        f"{vision.patch_size} and {vision.scale_factor}", ErrorKind.UNSUPPORTED_MODEL)
    return processor


def _read_video_processor(src: Path, vision, assets, image_processor):
    """A vision checkpoint's video preparation (flared.frontend.video), from its video_preprocessor_config.json (or
    processor_config.json's "video_processor"), transformers' class defaults where it ships neither: a Qwen
    family's; InternVL's, LLaVA-OneVision's and LLaVA-NeXT-Video's frames at the tower's tile size, where the chat
    template writes ``<video>``. None for the other families, or where the tokenizer lacks the tokens a video
    needs."""
    from flared.errors import FrontendError
    from flared.frontend.video import FrameVideoProcessor, PooledVideoProcessor, VideoProcessor

    qwen = vision.family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
    frames = vision.family in ("internvl", "llava_onevision") or (
        vision.family == "llava_next" and vision.video_pool and not vision.siglip_tower)  # (CLIP's video_stages)
    gemma4 = vision.family == "gemma4" and vision.video_token_id >= 0
    if not src.is_dir() or not (qwen and vision.video_token_id >= 0 or frames or gemma4):
        return None
    where = src / "video_preprocessor_config.json"
    cfg = _read_json(where, required=False)
    proc = _read_json(src / "processor_config.json", required=False)
    try:
        if gemma4:  # (its frames' boi and eoi are the image processor's; its settings maybe nested)
            if cfg is None and isinstance(proc, dict) and isinstance(proc.get("video_processor"), dict):
                cfg = proc["video_processor"]
            processor = PooledVideoProcessor.from_hf(cfg, patch_size=vision.patch_size,
                                                     pooling_kernel_size=vision.scale_factor)
            processor = dataclasses.replace(processor, start_token=image_processor.boi_token,
                                            end_token=image_processor.eoi_token)
        elif qwen:
            processor = VideoProcessor.from_hf("qwen3" if vision.family == "qwen3_vl" else "qwen2", cfg, proc,
                                               patch_size=vision.patch_size, merge_size=vision.scale_factor,
                                               temporal_patch_size=vision.temporal_patch_size)
        elif vision.family == "internvl":
            processor = FrameVideoProcessor.from_hf(
                cfg, height=image_processor.height, width=image_processor.width,
                image_seq_len=image_processor.image_seq_len, image_mean=image_processor.image_mean,
                image_std=image_processor.image_std)
        elif vision.family == "llava_onevision":  # (a frame's rows pooled to half the side)
            side = vision.patches_per_side
            processor = FrameVideoProcessor.from_hf(
                cfg, height=vision.image_size, width=vision.image_size, image_seq_len=math.ceil(side / 2) ** 2,
                image_mean=image_processor.image_mean, image_std=image_processor.image_std, family="onevision")
        else:  # (LLaVA-NeXT-Video: a frame's features average-pooled video_pool to a side)
            side = vision.patches_per_side // vision.video_pool
            processor = FrameVideoProcessor.from_hf(
                cfg, height=vision.image_size, width=vision.image_size, image_seq_len=side * side,
                image_mean=image_processor.image_mean, image_std=image_processor.image_std, family="llava_next_video")
    except FrontendError as e:
        raise CoreError(f"{where}: {e}", ErrorKind.SOURCE_FORMAT) from None
    tokenizer = assets.tokenizer
    if qwen:
        if tokenizer.token_to_id(processor.video_token) != vision.video_token_id:
            return None
        needed = (processor.vision_start, processor.vision_end)
    else:
        if processor.video_token not in (assets.chat_template or ""):
            return None
        if processor.fills_video_token:  # (its rows fill the video token the config names)
            if tokenizer.token_to_id(processor.video_token) != vision.video_token_id:
                return None
            needed = (processor.start_token, processor.end_token) if gemma4 else ()
        else:
            needed = (processor.image_token, processor.start_token, processor.end_token)
    if any(tokenizer.token_to_id(token) is None for token in needed):
        return None
    return processor


def _read_second_audio(src: Path, model, assets):
    """A second tower's audio preparation (Gemma 4 E2B's and E4B's: flared.frontend.audio.UsmProcessor), from
    processor_config.json's "feature_extractor" (transformers' defaults where it names none) and its
    "audio_seq_length"; None for a checkpoint without an audio tower, or whose tokenizer or chat template lacks the
    tokens a clip needs (its audio token the config's, <|audio>, <audio|>)."""
    from flared.errors import FrontendError
    from flared.frontend.audio import UsmProcessor

    if model.audio is None:
        return None
    if model.audio_processor is not None:  # (an mmproj's: flared.model.mmproj)
        extractor, proc = model.audio_processor
    elif src.is_dir():
        proc = _read_json(src / "processor_config.json", required=False) or {}
        extractor = proc.get("feature_extractor") if isinstance(proc, dict) else None
        if extractor is None:  # (or a preprocessor_config.json of its own settings)
            pre = _read_json(src / "preprocessor_config.json", required=False) or {}
            extractor = pre if isinstance(pre, dict) and "feature_extractor_type" in pre else {}
    else:
        return None
    try:
        processor = UsmProcessor.from_hf(extractor, proc if isinstance(proc, dict) else None)
    except FrontendError as e:
        raise CoreError(f"{src / 'processor_config.json'}: {e}", ErrorKind.SOURCE_FORMAT) from None
    if processor.feature_size != model.audio.mel_bins:
        raise CoreError(f"{src}: the feature extractor makes {processor.feature_size} mel bins, but the audio tower "
                        f"reads {model.audio.mel_bins}", ErrorKind.UNSUPPORTED_MODEL)
    tokenizer = assets.tokenizer
    if (tokenizer.token_to_id(processor.audio_token) != model.audio.image_token_id
            or any(tokenizer.token_to_id(t) is None for t in (processor.boa_token, processor.eoa_token))
            or processor.audio_token not in (assets.chat_template or "")):
        return None
    return processor


def _read_audio_processor(pre: dict, proc: dict | None, vision, where):
    """An audio model's feature extractor (preprocessor_config.json) and audio token (processor_config.json's
    ``audio_token``, the family's processor's default where absent: Qwen2-Audio's <|AUDIO|>, Audio Flamingo 3's
    <sound>, GLM-ASR's <|pad|>), checked against its encoder's mel bins. Audio Flamingo 3 and GLM-ASR take
    ``max_audio_len`` seconds (600, 655) in windows of the extractor's chunk; Qwen2-Audio one window."""
    from flared.errors import FrontendError
    from flared.frontend.audio import WhisperProcessor

    proc = proc or {}
    family = vision.family
    token = proc.get("audio_token", {"audioflamingo3": "<sound>", "glmasr": "<|pad|>"}.get(family, "<|AUDIO|>"))
    try:
        windows = 1
        if family in ("audioflamingo3", "glmasr"):  # (AudioFlamingo3Processor's windows; GlmAsrProcessor's)
            seconds = proc.get("max_audio_len", 600 if family == "audioflamingo3" else 655)
            windows = max(1, int(seconds) // int((pre or {}).get("chunk_length", 30)))
        processor = WhisperProcessor.from_hf(pre, audio_token=token, max_windows=windows, pool=vision.scale_factor,
                                             pad_windows=family == "glmasr")
    except (FrontendError, TypeError, ValueError, ZeroDivisionError) as e:
        raise CoreError(f"{where}: {e}", ErrorKind.SOURCE_FORMAT) from None
    if processor.feature_size != vision.mel_bins:
        raise CoreError(f"{where}: {processor.feature_size} mel bins, but the audio encoder takes {vision.mel_bins}",
                        ErrorKind.SOURCE_FORMAT)
    frames = processor.n_samples // processor.hop_length
    if frames != 2 * vision.position_table:  # (transformers insists too)
        raise CoreError(f"{where}: {processor.chunk_length}-second windows make {frames} frames, but the encoder's "
                        f"{vision.position_table} positions take {2 * vision.position_table}", ErrorKind.SOURCE_FORMAT)
    return processor


def _read_qwen3_asr_processor(pre: dict, proc: dict | None, vision, where):
    """Qwen3-ASR's feature extractor (a Qwen3ASRFeatureExtractor's settings; the released checkpoints' name it
    WhisperFeatureExtractor, which their own package runs alike: the clip's own frames, no 30 s window) and its audio
    token (``audio_token``, else Qwen3ASRProcessor's <|audio_pad|>), checked against the encoder."""
    from flared.errors import FrontendError
    from flared.frontend.audio import Qwen3AsrProcessor

    settings = dict(pre)
    if settings.get("feature_extractor_type") == "WhisperFeatureExtractor":
        settings["feature_extractor_type"] = "Qwen3ASRFeatureExtractor"
    try:
        processor = Qwen3AsrProcessor.from_hf(settings, audio_token=(proc or {}).get("audio_token", "<|audio_pad|>"))
    except FrontendError as e:
        raise CoreError(f"{where}: {e}", ErrorKind.SOURCE_FORMAT) from None
    if processor.feature_size != vision.mel_bins or processor.chunk_frames != vision.chunk_frames:
        raise CoreError(f"{where}: {processor.feature_size} mel bins in chunks of {processor.chunk_frames} frames, "
                        f"but the audio encoder takes {vision.mel_bins} and {vision.chunk_frames} (2 x n_window)",
                        ErrorKind.SOURCE_FORMAT)
    return processor


def _read_gguf_assets(src: Path) -> _Assets:
    from flared.frontend.gguf_tokenizer import tokenizer_from_gguf

    g = tokenizer_from_gguf(src)
    return _assets_from(g.tokenizer_json, g.chat_template, g.bos_token, g.eos_token, g.eos_token_id,
                        g.pad_token, {}, where=src)


def _assets_from(tokenizer_json: str, template: str | None, bos: str | None, eos: str | None,
                 extra_eos_ids, pad: Any, gcfg: dict, *, where: Path) -> _Assets:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(tokenizer_json)
    except Exception as e:  # tokenizers raises a bare Exception subclass
        raise CoreError(f"{where}: unreadable tokenizer: {e}", ErrorKind.SOURCE_FORMAT) from None
    bos_id = tok.token_to_id(bos) if bos else None
    eos_ids: list[int] = []
    if eos and tok.token_to_id(eos) is not None:
        eos_ids.append(tok.token_to_id(eos))
    for x in extra_eos_ids if isinstance(extra_eos_ids, list) else [extra_eos_ids]:
        if isinstance(x, int) and x not in eos_ids:
            eos_ids.append(x)
    if not eos_ids:
        raise CoreError(f"{where}: no end-of-sequence token found", ErrorKind.SOURCE_FORMAT)
    # Whether encoding adds BOS is the tokenizer's post-processor's decision; record what it does.
    probe = tok.encode("a", add_special_tokens=True).ids
    add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
    pad_text = _token_text(pad)
    pad_id = tok.token_to_id(pad_text) if pad_text else None
    defaults = {k: gcfg[k] for k in GENERATION_DEFAULT_KEYS
                if isinstance(gcfg.get(k), (int, float)) and not isinstance(gcfg.get(k), bool)}
    return _Assets(
        tokenizer_json=tokenizer_json,
        chat_template=template,
        tokens=TokenSpec(bos_token=bos, bos_token_id=bos_id, eos_token=eos, eos_token_ids=tuple(eos_ids),
                         pad_token_id=pad_id, add_bos_token=add_bos),
        generation_defaults=defaults,
        tokenizer=tok,
    )


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):  # serialized AddedToken
        v = v.get("content")
    return v if isinstance(v, str) and v else None


def _read_json(path: Path, *, required: bool = True) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if required:
            raise CoreError(f"{path}: missing", ErrorKind.SOURCE_FORMAT) from None
        return None
    except (ValueError, UnicodeDecodeError) as e:
        raise CoreError(f"{path}: not valid JSON: {e}", ErrorKind.SOURCE_FORMAT) from None


def _source_info(source: Path, kind: str) -> dict[str, Any]:
    if source.is_file():
        files = [source]
    else:
        files = sorted(p for p in source.iterdir() if p.is_file() and p.suffix in (".safetensors", ".json"))
    info = {"kind": kind, "name": source.name, "files": {p.name: sha256_file(p) for p in files}}
    if kind == "gguf":  # each matrix's ggml type and size: --quantization gguf keeps each at about its bits
        from flared.frontend.gguf_metadata import matrix_types

        info["tensor_types"] = matrix_types(source)
    return info


def _slug(name: str) -> str:
    s = re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-.")
    return s or "model"


def _set_public_modes(d: Path) -> None:
    # mkdtemp makes the staging directory private (0700); a finished core is
    # read by the service user, so give it the modes the umask allows.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(d, 0o777 & ~umask)
    for p in d.iterdir():
        os.chmod(p, 0o666 & ~umask)


def _fsync_dir_files(d: Path) -> None:
    for p in d.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(staging: Path, out: Path) -> None:
    """Move the finished staging directory to ``out``, replacing an old core last."""
    if not out.exists():
        os.rename(staging, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.rename(out, old)
    try:
        os.rename(staging, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
