"""The cores flared keeps in its cache (`flarectl cache list` / `flarectl cache prune`).

The cache (``~/.cache/flared/cores`` by default: ``flarectl``'s and ``flared run``'s ``--cache-dir``) holds the
embedded model's cores (``smollm2-135m-instruct-VERSION-fFORMAT-DTYPE...``) and, under ``sources/``, the cores of
GGUF files and checkpoint directories served directly (sources.source_core_dir), each beside a stamp
(``NAME.source.json``) of the source's files it was exported from. Nothing removed them: a source edited or deleted,
a core exported by an older flared (another core format, another embedded model release), or a source served as
another dtype or storage (``...-bfloat16`` and ``...-bfloat16-q4_1``) each left a core behind, hundreds of MB to
tens of GB. ``cached_cores`` says what each is; ``prune`` removes those no `flared run` would use again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from flared.core.default import _is_core, _records_gguf_types, default_core_dir
from flared.core.manifest import FORMAT_VERSION

# What a cached core is: CURRENT (`flared run` of its source, dtype and options would use it as it is), STALE (its
# source's files changed since: it would be exported again), ORPHANED (its source is gone), OLD (exported by another
# core format or, the embedded model's, another release of its package), UNUSED (a bfloat16 core of a source this
# machine serves from a sibling stored otherwise by default: a GGUF's plain core where a CPU keeps its bits,
# `...-bfloat16-gguf`, or that stored core on a GPU, which serves the plain one; a start with -q does use the plain
# one, so `prune` removes these only when asked), INCOMPLETE (an export that did not finish: no manifest or no
# stamp). `prune` removes STALE, ORPHANED, OLD and INCOMPLETE ones.
CURRENT, STALE, ORPHANED, OLD, UNUSED, INCOMPLETE = "current", "stale", "orphaned", "old", "unused", "incomplete"
_EMBEDDED = re.compile(r"^smollm2-135m-instruct-.+-f\d+-")  # (default.default_core_dir's names, any release)
# A source core's name (sources.source_core_dir): ...-fFORMAT-DTYPE[-STORED][capacities]
_SOURCE = re.compile(r"-f(?P<format>\d+)-(?P<dtype>[a-z0-9]+?)(?:-(?P<stored>gguf|q4_1|q8_0))?(?P<caps>(?:-[a-z]+\d+)*)$")


@dataclass(frozen=True)
class CachedCore:
    path: Path
    source: str  # the source it was exported from: a path, or "default" (the embedded model)
    state: str
    size_bytes: int

    def to_dict(self) -> dict:
        return {"path": str(self.path), "source": self.source, "state": self.state, "size_bytes": self.size_bytes}


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _embedded_state(path: Path) -> str:
    """CURRENT where ensure_default_core would serve it as it is (this release's name, default.default_core_dir's,
    and a manifest recording its GGUF's types)."""
    if not _is_core(path):
        return INCOMPLETE
    if not path.name.startswith(default_core_dir(path.parent, "").name) or not _records_gguf_types(path):
        return OLD
    return CURRENT


def _source_state(path: Path) -> tuple[str, str]:
    """(the source recorded in the core's stamp, or "?" where there is none; the core's state)."""
    from flared.core.sources import fingerprint, source_kind

    stamp = path.with_name(path.name + ".source.json")
    try:
        recorded = json.loads(stamp.read_text(encoding="utf-8"))
        source = str(recorded["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return "?", INCOMPLETE
    if not _is_core(path):  # (as ensure_source_core judges it)
        return source, INCOMPLETE
    name = _SOURCE.search(path.name)
    if name is None or int(name.group("format")) != FORMAT_VERSION:
        return source, OLD
    if source_kind(source) is None:
        return source, ORPHANED
    try:
        same = fingerprint(Path(source)) == recorded
    except OSError:
        return source, ORPHANED
    if not same:
        return source, STALE
    if name.group("dtype") == "bfloat16" and name.group("stored") != served_stored(source):
        return source, UNUSED
    return source, CURRENT


def served_stored(source: str) -> str | None:
    """How `flared run` on this machine stores a source's bfloat16 core when neither -q nor the config says
    (sources.kept_quantization: a CPU keeps a GGUF's or quantised checkpoint's bits, a GPU serves bf16)."""
    from flared.core.sources import kept_quantization

    return kept_quantization(source)[0]


def cached_cores(cache_dir: Path) -> list[CachedCore]:
    """Every core in the cache, the embedded model's first, each with its source and state; [] where there is no
    cache."""
    cache_dir = Path(cache_dir)
    out = []
    if cache_dir.is_dir():
        for path in sorted(p for p in cache_dir.iterdir() if p.is_dir() and _EMBEDDED.match(p.name)):
            out.append(CachedCore(path, "default", _embedded_state(path), _size(path)))
    sources = cache_dir / "sources"
    if sources.is_dir():
        for path in sorted(p for p in sources.iterdir() if p.is_dir()):
            source, state = _source_state(path)
            out.append(CachedCore(path, source, state, _size(path)))
    return out


def prune(cache_dir: Path, *, unused: bool = False, everything: bool = False,
          dry_run: bool = False) -> list[CachedCore]:
    """Remove the cached cores that are neither CURRENT nor UNUSED (``unused``: UNUSED ones too; ``everything``: all
    of them), with their stamps; returns those removed (``dry_run``: those it would remove, removing nothing). Holds
    the cache's export lock meanwhile, so no `flared run` exports into it at the same time (a daemon serving a core
    it removes keeps serving it: its weights are in memory)."""
    kept = {CURRENT} if unused else {CURRENT, UNUSED}
    cache_dir = Path(cache_dir)
    roots = [root for root in (cache_dir, cache_dir / "sources") if root.is_dir()]
    with contextlib.ExitStack() as locks:
        for root in roots:  # (the embedded model's exports lock the cache, the sources' exports sources/)
            fcntl.flock(locks.enter_context(open(root / ".export.lock", "w")), fcntl.LOCK_EX)
        removed = [core for core in cached_cores(cache_dir) if everything or core.state not in kept]
        if not dry_run:
            for core in removed:
                shutil.rmtree(core.path)
                core.path.with_name(core.path.name + ".source.json").unlink(missing_ok=True)
            for root in roots:  # (a stamp whose core is gone)
                for stamp in root.glob("*.source.json"):
                    if not stamp.with_name(stamp.name.removesuffix(".source.json")).exists():
                        stamp.unlink(missing_ok=True)
    return removed
