"""The cores in flared's cache (flared/core/cache.py; `flarectl cache list` and `flarectl cache prune`): each core's
state from its stamp and its source, and pruning only those no `flared run` would use again."""

from __future__ import annotations

import json
import os
import shutil

from click.testing import CliRunner

from flared.cli.ctl import main as flarectl
from flared.core.cache import CURRENT, INCOMPLETE, OLD, ORPHANED, STALE, UNUSED, cached_cores, prune, served_stored
from flared.core.sources import ensure_source_core


def test_each_cached_core_has_its_state_and_prune_keeps_the_current_ones(tiny_hf_llama, tmp_path):
    cache = tmp_path / "cache"
    sources = {}
    for name in ("kept", "edited", "deleted"):
        sources[name] = tmp_path / name
        shutil.copytree(tiny_hf_llama, sources[name])
    cores = {name: ensure_source_core(src, cache, "float32") for name, src in sources.items()}
    # a second core of one source (another dtype), current too
    cores["kept-bf16"] = ensure_source_core(sources["kept"], cache, "bfloat16")
    weights = next(sources["edited"].glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    shutil.rmtree(sources["deleted"])
    # an export cut short (no stamp), one of another core format, and the embedded model's of another release
    cut = cores["kept"].with_name(cores["kept"].name.replace("float32", "float16"))
    shutil.copytree(cores["kept"], cut)
    old = cores["kept"].with_name(cores["kept"].name.replace("-f1-", "-f0-"))
    shutil.copytree(cores["kept"], old)
    shutil.copy(cores["kept"].with_name(cores["kept"].name + ".source.json"), old.with_name(old.name + ".source.json"))
    embedded = cache / "smollm2-135m-instruct-0.0.1-f1-float32"
    shutil.copytree(cores["kept"], embedded)
    got = {c.path: (c.state, c.source) for c in cached_cores(cache)}
    assert got == {cores["kept"]: (CURRENT, str(sources["kept"].resolve())),
                   cores["kept-bf16"]: (CURRENT, str(sources["kept"].resolve())),
                   cores["edited"]: (STALE, str(sources["edited"].resolve())),
                   cores["deleted"]: (ORPHANED, str(sources["deleted"].resolve())),
                   cut: (INCOMPLETE, "?"), old: (OLD, str(sources["kept"].resolve())), embedded: (OLD, "default")}
    assert all(c.size_bytes > 10_000 for c in cached_cores(cache))
    assert {c.path for c in prune(cache, dry_run=True)} == {cores["edited"], cores["deleted"], cut, old, embedded}
    assert len(cached_cores(cache)) == 7  # (a dry run removes nothing)
    removed = prune(cache)
    assert {c.path for c in removed} == {cores["edited"], cores["deleted"], cut, old, embedded}
    assert {c.path for c in cached_cores(cache)} == {cores["kept"], cores["kept-bf16"]}
    assert sorted(p.name for p in (cache / "sources").iterdir() if not p.name.startswith(".")) == sorted(
        [cores["kept"].name, cores["kept"].name + ".source.json", cores["kept-bf16"].name,
         cores["kept-bf16"].name + ".source.json"])
    # the edited source's core comes back when it is served again
    assert ensure_source_core(sources["edited"], cache, "float32") == cores["edited"]
    assert {c.state for c in cached_cores(cache)} == {CURRENT}
    assert len(prune(cache, everything=True)) == 3 and cached_cores(cache) == []


def test_a_gguf_cores_other_storage_is_unused_here(default_gguf, tmp_path):
    """A GGUF's bfloat16 core stored at its bits (...-bfloat16-gguf, what a CPU with the quantised kernels serves) and
    plain (what a GPU serves, what a CPU served before it kept the bits, and what -q serves): the one this machine
    would not serve by default is UNUSED, and prune removes it when asked."""
    cache = tmp_path / "cache"
    plain = ensure_source_core(default_gguf, cache, "bfloat16")
    stored = ensure_source_core(default_gguf, cache, "bfloat16", stored="gguf")
    here = served_stored(str(default_gguf))  # ("gguf" on a CPU with the kernels; None on a GPU or without them)
    states = {c.path: c.state for c in cached_cores(cache)}
    assert states == {plain: UNUSED if here == "gguf" else CURRENT, stored: CURRENT if here == "gguf" else UNUSED}
    assert prune(cache) == []
    assert [c.path for c in prune(cache, unused=True)] == [plain if here == "gguf" else stored]


def test_flarectl_cache_lists_and_prunes(tiny_hf_llama, tmp_path):
    cache = tmp_path / "cache"
    source = tmp_path / "m"
    shutil.copytree(tiny_hf_llama, source)
    core = ensure_source_core(source, cache, "float32")
    shutil.rmtree(source)
    listed = CliRunner().invoke(flarectl, ["cache", "list", "--cache-dir", str(cache), "--json"])
    assert listed.exit_code == 0, listed.output
    body = json.loads(listed.output)
    assert [(c["path"], c["state"]) for c in body["cores"]] == [(str(core), ORPHANED)]
    assert body["size_bytes"] == body["cores"][0]["size_bytes"] > 0
    text = CliRunner().invoke(flarectl, ["cache", "list", "--cache-dir", str(cache)])
    assert text.exit_code == 0 and "orphaned" in text.output and core.name in text.output and "1 cores" in text.output
    dry = CliRunner().invoke(flarectl, ["cache", "prune", "--cache-dir", str(cache), "--dry-run"])
    assert dry.exit_code == 0 and f"would remove {core}" in dry.output and core.is_dir()
    done = CliRunner().invoke(flarectl, ["cache", "prune", "--cache-dir", str(cache), "--json"])
    assert done.exit_code == 0 and json.loads(done.output)["removed"][0]["path"] == str(core)
    assert not core.exists()
    empty = CliRunner().invoke(flarectl, ["cache", "list", "--cache-dir", str(tmp_path / "none"), "--json"])
    assert empty.exit_code == 0 and json.loads(empty.output) == {"cores": [], "size_bytes": 0}
