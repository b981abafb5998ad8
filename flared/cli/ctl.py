"""`flarectl`: the admin and tooling CLI.

Only this layer reads the environment (click's auto_envvar_prefix FLARECTL);
everything below takes explicit arguments.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from flared.errors import FlareError


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flared" / "cores"


def _fail(e: Exception) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(1)


def resolve_core(core: str, cache_dir: Path | None) -> Path:
    """A core path, or ``default`` for the embedded model (exported on first use)."""
    if core == "default":
        from flared.core.default import ensure_default_core

        return ensure_default_core(cache_dir or default_cache_dir())
    return Path(core)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "FLARECTL"})
@click.version_option(package_name="flared")
def main() -> None:
    """Administer flared and prepare cores."""


@main.command()
@click.argument("source")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Core directory to write.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--context", "context", type=int, default=None, help="Context limit in tokens (default: the model's, at most 8192).")
@click.option("--concurrency", type=int, default=32, show_default=True, help="Live request slots (at most 64).")
@click.option("--page-tokens", type=int, default=64, show_default=True, help="KV cache page size in tokens.")
@click.option("--prefill-chunk", "prefill_chunk", type=int, default=512, show_default=True, help="Largest prefill chunk (multiple of 64).")
@click.option("--kv-cache-mib", type=int, default=2048, show_default=True, help="KV cache budget in MiB.")
@click.option("--served-name", "served_names", multiple=True, help="Model name clients use (repeatable).")
@click.option("--force", is_flag=True, help="Replace an existing core at --out.")
def export(source, out, dtype, context, concurrency, page_tokens, prefill_chunk, kv_cache_mib, served_names, force):
    """Export SOURCE (a Hugging Face directory, a .gguf file, or 'default') to a core."""
    from flared.core.export import ExportOptions, export_core

    try:
        if source == "default":
            from flared.core.default import SERVED_NAMES, default_gguf_path

            source = default_gguf_path()
            served_names = served_names or SERVED_NAMES
        options = ExportOptions(dtype=dtype, context_tokens=context, concurrency=concurrency,
                                page_tokens=page_tokens, prefill_chunk_tokens=prefill_chunk,
                                kv_cache_mib=kv_cache_mib, served_names=tuple(served_names))
        started = time.monotonic()
        manifest = export_core(source, out, options, force=force)
    except FlareError as e:
        _fail(e)
    click.echo(f"wrote {out} ({manifest.architecture}, {manifest.dtype}, "
               f"context {manifest.capacities.context_tokens}, id {manifest.checkpoint_id}) "
               f"in {time.monotonic() - started:.1f}s")


@main.command()
@click.argument("core")
@click.option("--prompt", default=None, help="Raw prompt text (no chat template).")
@click.option("--messages", default=None, help="Chat messages as a JSON list, rendered with the core's template.")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=None, help="0 is greedy (default: the core's default, else 0).")
@click.option("--top-p", type=float, default=None)
@click.option("--top-k", type=int, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the text.")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None, help="Where the default core is cached.")
def generate(core, prompt, messages, max_tokens, temperature, top_p, top_k, seed, as_json, cache_dir):
    """One-shot local generation on CORE (a core directory or 'default')."""
    from flared.runtime.oneshot import OneShot

    if (prompt is None) == (messages is None):
        _fail(click.UsageError("give exactly one of --prompt and --messages"))
    try:
        parsed = None
        if messages is not None:
            try:
                parsed = json.loads(messages)
            except ValueError as e:
                raise click.UsageError(f"--messages is not valid JSON: {e}")
            if not isinstance(parsed, list) or not all(isinstance(m, dict) for m in parsed):
                raise click.UsageError("--messages must be a JSON list of message objects")
        t0 = time.monotonic()
        engine = OneShot.open(resolve_core(core, cache_dir))
        load_s = time.monotonic() - t0
        result = engine.generate(prompt=prompt, messages=parsed, max_tokens=max_tokens,
                                 temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    except (FlareError, click.UsageError) as e:
        _fail(e)
    if as_json:
        out = dict(result)
        out["timings"] = {"load_s": round(load_s, 4), **result["timings"]}
        click.echo(json.dumps(out, ensure_ascii=False))
    else:
        click.echo(result["text"])


if __name__ == "__main__":
    main()
