"""Serving a model source directly: `flared run model.gguf`, `flared run ./hf-checkpoint`.

A GGUF file or a Hugging Face checkpoint directory given where a core is expected is exported once into the cache,
as the embedded default model is (flared/core/default.py), and that core is served. Later runs find it and reuse it
while the source is unchanged: its files' names, sizes and modification times, kept beside the core, must match. A
changed source is exported again over the same core (one core a source path and dtype, so replacing a file leaves
no stale copy behind). The export runs in a separate process (`flarectl export`) under a lock, so two daemons
started together export once.

The core takes export's default capacities (context: the model's, at most 8192; 32 request slots; a 2 GiB KV
cache) unless `flared run` is given others (`--context`, `--concurrency`, `--kv-cache-mib`, as `flarectl export`
takes them): each set of them is a core of its own in the cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from flared.core.default import _is_core
from flared.core.manifest import FORMAT_VERSION
from flared.errors import CoreError, ErrorKind

GGUF_MAGIC = b"GGUF"
# The files of a checkpoint directory whose change means a new export (export's own choice of files to hash, plus
# the tokenizer and template files it reads)
_CHECKPOINT_SUFFIXES = (".safetensors", ".json", ".jinja", ".model", ".txt")
PROGRESS_S = 30.0
# What a cached core was exported by, in its stamp: a change exports the cores of earlier revisions again (2: a GGUF
# file's core records its tensors' types, for --quantization gguf)
EXPORT_REVISION = 2


def source_kind(path: str | os.PathLike) -> str | None:
    """"gguf" (a file that starts with GGUF's magic), "hf" (a directory with config.json and no manifest.json), or
    None: a core, or something that is neither (loading it then says what is wrong)."""
    path = Path(path)
    if path.is_file():
        try:
            with open(path, "rb") as f:
                return "gguf" if f.read(4) == GGUF_MAGIC else None
        except OSError:
            return None
    if path.is_dir() and (path / "config.json").is_file() and not (path / "manifest.json").exists():
        return "hf"
    return None


def source_core_dir(source: Path, cache_dir: Path, dtype: str, capacities: dict[str, int] | None = None,
                    stored: str | None = None, mmproj: Path | None = None) -> Path:
    """Where ``source``'s core is cached: its name, a digest of its resolved path, the core format, the dtype, how
    its layer matrices are stored (``stored``: export's --quantization), any capacities asked for
    (``capacity_suffix``) and a digest of the image tower's path (``mmproj``: export's --mmproj)."""
    resolved = source.resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in resolved.name.lower()).strip("-.") or "model"
    tower = f"-mmproj{hashlib.sha256(str(Path(mmproj).resolve()).encode()).hexdigest()[:8]}" if mmproj else ""
    return Path(cache_dir) / "sources" / (f"{name}-{digest}-f{FORMAT_VERSION}-{dtype}{'-' + stored if stored else ''}"
                                          f"{capacity_suffix(capacities)}{tower}")


# The capacities a core served from the cache may be exported with: `flared run`'s options, `flarectl export`'s
# flags of the same names
CAPACITIES = ("context", "concurrency", "kv_cache_mib", "prefill_chunk")


def capacity_suffix(capacities: dict[str, int] | None) -> str:
    """The cached core's name's ending for the capacities asked for ("" for export's defaults), one core each."""
    return "".join(f"-{key.replace('_', '')}{value}" for key, value in sorted((capacities or {}).items()))


def capacity_args(capacities: dict[str, int] | None) -> list[str]:
    """`flarectl export`'s flags for them."""
    return [arg for key, value in sorted((capacities or {}).items())
            for arg in (f"--{key.replace('_', '-')}", str(value))]


def fingerprint(source: Path, mmproj: Path | None = None) -> dict:
    """The source's files (and the image tower's, ``mmproj``) as {name: [size, mtime_ns]}: what a reused core must
    still match."""
    if source.is_file():
        files = [source]
    else:
        files = sorted(p for p in source.iterdir() if p.is_file() and p.suffix in _CHECKPOINT_SUFFIXES)
    out = {}
    for p in files:
        st = p.stat()
        out[p.name] = [st.st_size, st.st_mtime_ns]
    found = {"source": str(source.resolve()), "files": out, "export": EXPORT_REVISION}
    if mmproj is not None:
        st = Path(mmproj).stat()
        found["mmproj"] = [str(Path(mmproj).resolve()), st.st_size, st.st_mtime_ns]
    return found


def ensure_source_core(source: str | os.PathLike, cache_dir: Path, dtype: str = "auto",
                       progress: Callable[[str], None] | None = None,
                       capacities: dict[str, int] | None = None, stored: str | None = None,
                       mmproj: str | os.PathLike | None = None) -> Path:
    """``source``'s core in the cache, exported first where it is missing or the source has changed since
    (``dtype`` "auto": default.preferred_dtype()). Its served name is export's (the file's or directory's name);
    the daemon adds the source as given (``served_source_name``). ``progress``, if given, hears a line when an
    export starts and every PROGRESS_S while it runs (the daemon tells systemd, whose start timeout a large
    model's export could pass). ``capacities`` (keys of CAPACITIES): export's flags of those names, a core of
    their own in the cache; ``stored``: export's --quantization (the layer matrices stored so, in bfloat16), a core
    of its own too; ``mmproj``: export's --mmproj (a GGUF's image tower, llama.cpp's file), likewise."""
    from flared.core.default import preferred_dtype

    source = Path(source)
    if source_kind(source) is None:
        raise CoreError(f"{source}: neither a core, a GGUF file nor a Hugging Face checkpoint directory",
                        ErrorKind.CORE_MISSING)
    if mmproj is not None:
        mmproj = Path(mmproj)
        if source_kind(source) != "gguf":
            raise CoreError(f"--mmproj goes with a GGUF model ({source} is not a GGUF file): a checkpoint directory "
                            "holds its own image tower", ErrorKind.VALIDATION)
        if not mmproj.is_file():
            raise CoreError(f"--mmproj {mmproj}: no such file", ErrorKind.CORE_MISSING)
    if dtype == "auto":
        dtype = preferred_dtype()
    if stored is not None and dtype != "bfloat16":
        stored = None  # (stored quantised over bfloat16 only: a float32 core keeps them plain)
    out = source_core_dir(source, cache_dir, dtype, capacities, stored, mmproj)
    stamp = out.with_name(out.name + ".source.json")
    wanted = fingerprint(source, mmproj)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".export.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_core(out) and _read_stamp(stamp) == wanted:
            return out
        again = " again (the source has changed)" if _is_core(out) else ""
        print(f"flared: exporting {source} to {out}{again} (once)", file=sys.stderr)
        stamp.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "flared.cli.ctl", "export", str(source), "--out", str(out), "--dtype", dtype,
               "--force", *capacity_args(capacities), *(["--quantization", stored] if stored else []),
               *(["--mmproj", str(mmproj)] if mmproj else [])]
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=sys.stderr.fileno())  # (keep our stdout clean for --json callers)
        while True:
            if progress is not None:
                progress(f"exporting {source.name} into the cache ({time.monotonic() - started:.0f} s)")
            try:
                proc.wait(PROGRESS_S)
                break
            except subprocess.TimeoutExpired:
                continue
        if proc.returncode != 0:
            raise CoreError(f"exporting {source} failed (exit {proc.returncode})", ErrorKind.CORE_FORMAT)
        stamp.write_text(json.dumps(wanted), encoding="utf-8")
    return out


def served_source_name(core: str | None) -> tuple[str, ...]:
    """The name a source served directly is also known by: the argument as given, as vLLM (`vllm serve PATH`) and
    llama.cpp's server (`-m PATH`) name their model; () for a core or the embedded model."""
    return (core,) if core is not None and core != "default" and source_kind(core) is not None else ()


def gguf_quantization(path: str | os.PathLike) -> tuple[str | None, str]:
    """The quantization (flared's "q4_1", "q8_0", or None) that keeps most of a GGUF's layer weights at about the
    bits the file holds them in, and a word on what those are ("Q4_K 86%, Q6_K 14%"): by the weights in each type
    (IQ types count as 4 bits; F16, BF16 and F32 as none). quant.gguf_plan keeps each matrix at its own."""
    from flared.frontend.gguf_metadata import matrix_types
    from flared.model.quant import gguf_plan

    types = matrix_types(path)
    counts: dict[str, int] = {}
    for name, (type_name, n) in types.items():
        if name.startswith("blk."):
            counts[type_name] = counts.get(type_name, 0) + n
    total = sum(counts.values())
    if not total:
        return None, "no layer matrices"
    words = ", ".join(f"{name} {n / total:.0%}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    plan = gguf_plan(types)  # (its default: the format most of the layer weights are in)
    return (plan.default if plan is not None else None), words


def checkpoint_quantization(directory: str | os.PathLike) -> tuple[str | None, str]:
    """The quantization ("q4_1", "q8_0") that keeps a quantised checkpoint directory's matrices at about the bits
    it holds them in (GPTQ, AWQ or compressed-tensors at 4 bits or fewer: q4_1; at 8, or fp8: q8_0; several widths:
    the most of them; bitsandbytes' NF4 and FP4, whose levels no even grid holds, and its int8: q8_0), and a word on
    what they are ("gptq 4-bit in groups of 128"); (None, "") for a plain checkpoint, or one the loader will refuse
    (it says why)."""
    from flared.model.checkpoint_quant import parse, quantization_config_of

    try:
        config = json.loads((Path(directory) / "config.json").read_text(encoding="utf-8"))
        quant = parse(quantization_config_of(directory, config), str(directory))
    except (OSError, ValueError, AttributeError, CoreError):
        return None, ""
    if quant is None:
        return None, ""
    bits = quant.bits or max(quant.settings.get("widths") or [8])
    words = f"{quant.method} {bits}-bit" + (f" in groups of {quant.group_size}" if quant.group_size else "")
    if quant.method == "bitsandbytes":  # (NF4's and FP4's 16 levels are not evenly spaced: Q4_1's grid misses
        # them, 0.38 nats of KL against q8_0's 0.003 on the embedded model; docs/benchmarks.md)
        return "q8_0", f"bitsandbytes {quant.settings.get('type', 'int8')} {bits}-bit"
    if quant.settings.get("float"):  # (float weights: fp8, or FP4 whose levels 0, 0.5, 1, 1.5, 2, 3, 4, 6 no even
        # grid holds either)
        return "q8_0", f"{quant.method} fp{bits}"
    return ("q4_1" if bits <= 4 else "q8_0"), words


def kept_quantization(core: str | os.PathLike | None) -> tuple[str | None, str]:
    """("gguf" and gguf_quantization's words) where ``core`` is a GGUF file whose weights this machine keeps at
    about the file's bits, each layer matrix at its own (quant.gguf_plan), and checkpoint_quantization's format and
    words where it is a quantised checkpoint directory: its model runs on the CPU (no CUDA backend here) with the
    quantised kernels, and the source holds most of its layer weights quantised. Else (None, "")."""
    kind = source_kind(core) if core is not None and str(core) != "default" else None
    if kind is None:
        return None, ""
    import torch

    from flared.runtime.worker import cuda_backend_available

    try:
        from flared._fast.linear import BF16_SUPPORTED, QUANTISER
    except ImportError:
        return None, ""
    if not (BF16_SUPPORTED and QUANTISER) or cuda_backend_available(torch.bfloat16):
        return None, ""
    if kind == "hf":
        return checkpoint_quantization(core)
    fmt, words = gguf_quantization(core)
    return ("gguf" if fmt is not None else None), words


def _read_stamp(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
