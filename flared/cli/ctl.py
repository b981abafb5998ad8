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

from flared.errors import CoreError, ErrorKind, FlareError


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flared" / "cores"


def _fail(e: Exception) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(1)


def resolve_core(core: str, cache_dir: Path | None, dtype: str = "float32", progress=None,
                 capacities: dict[str, int] | None = None, stored: str | None = None,
                 mmproj: str | None = None) -> Path:
    """A core path; ``default`` for the embedded model; a GGUF file or a Hugging Face checkpoint directory for its
    core in the cache (flared/core/sources.py). The last two are exported on first use, in ``dtype`` (``progress``
    hears how it goes), with ``capacities`` (export's --context, --concurrency, --kv-cache-mib, --prefill-chunk)
    where given, their layer matrices stored as ``stored`` (export's --quantization) where it names one, and a GGUF's
    image tower from ``mmproj`` (llama.cpp's file) where given; a core's own were fixed when it was exported."""
    capacities = {k: v for k, v in (capacities or {}).items() if v is not None}
    if core == "default" and mmproj is not None:
        raise CoreError("--mmproj goes with a GGUF model served directly, not the embedded model",
                        ErrorKind.VALIDATION)
    if core == "default":
        from flared.core.default import ensure_default_core

        return ensure_default_core(cache_dir or default_cache_dir(), dtype, capacities)
    from flared.core.sources import ensure_source_core, source_kind

    if source_kind(core) is not None:
        return ensure_source_core(core, cache_dir or default_cache_dir(), dtype, progress, capacities, stored, mmproj)
    if mmproj is not None:
        raise CoreError(f"--mmproj goes with a GGUF model served directly; {core} is a core (export it again with "
                        "flarectl export MODEL.gguf --mmproj FILE)", ErrorKind.VALIDATION)
    if capacities:
        flags = ", ".join("--" + k.replace("_", "-") for k in capacities)
        raise CoreError(f"{core} is a core: its capacities were fixed when it was exported ({flags} apply to the "
                        f"embedded model or a GGUF file or checkpoint served directly; export the core again with "
                        f"flarectl export {flags} for others)", ErrorKind.VALIDATION)
    return Path(core)


def capacity_options(fn):
    """The capacities the embedded model or a GGUF file or checkpoint served directly is exported with (export's
    flags; vLLM's and llama.cpp's names too): a core of their own in the cache."""
    fn = click.option("--prefill-chunk", "--max-num-batched-tokens", "--ubatch-size", "-ub", "prefill_chunk",
                      type=int, default=None,
                      help="Embedded model or a GGUF file / checkpoint served directly: the most prompt tokens a "
                           "step takes, a multiple of 64 (default 512; vLLM's --max-num-batched-tokens, llama.cpp's "
                           "--ubatch-size).")(fn)
    fn = click.option("--kv-cache-mib", "kv_cache_mib", type=int, default=None,
                      help="Embedded model or a GGUF file / checkpoint served directly: its KV cache budget in MiB "
                           "(default 2048).")(fn)
    fn = click.option("--concurrency", "--max-num-seqs", "--parallel", "-np", "concurrency", type=int, default=None,
                      help="Embedded model or a GGUF file / checkpoint served directly: its live request slots "
                           "(default 32, at most 64).")(fn)
    return click.option("--context", "--max-model-len", "--ctx-size", "-c", "context", type=int, default=None,
                        help="Embedded model or a GGUF file / checkpoint served directly: its context limit in tokens "
                             "(default: the model's, at most 8192).")(fn)


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
@click.option("--quantization", "-q", type=click.Choice(["q8_0", "q4_1", "gguf"], case_sensitive=False), default=None,
              help="Store the layer matrices quantised, as the CPU kernels take them (needs --dtype bfloat16): q8_0, "
                   "q4_1, or gguf (each at about the bits of its GGUF tensors). The core is then 0.3-0.6x the size "
                   "and loads without quantising; a GPU takes the values back to bfloat16 (flared run -q in "
                   "the core's format keeps them quantised there too).")
@click.option("--mmproj", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A GGUF model's image tower or audio encoder: llama.cpp's mmproj file (SmolVLM, Mistral Small "
                   "3.1, Pixtral 12B, Gemma 3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, InternVL; Qwen2-Audio, Audio Flamingo "
                   "3), read into the core so that it takes images or audio.")
def export(source, out, dtype, context, concurrency, page_tokens, prefill_chunk, kv_cache_mib, served_names, force,
           quantization, mmproj):
    """Export SOURCE (a Hugging Face directory, a .gguf file, or 'default') to a core."""
    from flared.core.export import ExportOptions, export_core

    try:
        if source == "default":
            from flared.core.default import SERVED_NAMES, default_gguf_path

            source = default_gguf_path()
            served_names = served_names or SERVED_NAMES
        options = ExportOptions(dtype=dtype, context_tokens=context, concurrency=concurrency,
                                page_tokens=page_tokens, prefill_chunk_tokens=prefill_chunk,
                                kv_cache_mib=kv_cache_mib, served_names=tuple(served_names),
                                quantization=quantization.lower() if quantization else None, mmproj=mmproj)
        started = time.monotonic()
        manifest = export_core(source, out, options, force=force)
    except FlareError as e:
        _fail(e)
    stored = manifest.weights_quantization
    click.echo(f"wrote {out} ({manifest.architecture}, {manifest.dtype}"
               f"{', layer matrices as ' + stored['default'] if stored else ''}, "
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
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="Where exported cores are cached (the default model's, and those of a GGUF file or checkpoint "
                   "given directly).")
@capacity_options
@click.option("--quantization", "-q", type=click.Choice(["q8_0", "q4_1", "gguf", "none"], case_sensitive=False),
              default=None,
              help="Keep a bfloat16 core's weights as q8_0 (int8 in blocks of 32), q4_1 (4 bits in blocks of 32; "
                   "docs/model.md) or gguf (each layer matrix at about the bits of its GGUF tensors), or none "
                   "(default: as the core is; a GGUF file on the CPU, as gguf; a quantised checkpoint on the CPU, "
                   "q4_1 or q8_0 by its bits).")
def generate(core, prompt, messages, max_tokens, temperature, top_p, top_k, seed, as_json, cache_dir, quantization,
             context, concurrency, kv_cache_mib, prefill_chunk):
    """One-shot local generation on CORE (a core directory, 'default', a GGUF file or a Hugging Face checkpoint
    directory)."""
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
        quantization = quantization.lower() if quantization else None
        stored = False
        if quantization is None:  # (a GGUF file or quantised checkpoint on the CPU: at about its bits, as `flared
            # run` serves it)
            from flared.core.sources import kept_quantization

            quantization, words = kept_quantization(core)
            stored = quantization is not None
            if quantization is not None:
                click.echo(f"{core} holds its layers' weights as {words}: each run at about its bits (-q none: "
                           f"float32)", err=True)
        elif quantization == "none":
            quantization = None
        # (the embedded model or a source in bfloat16 where its weights are to be quantised: that takes a bf16 core)
        # (a source kept at its bits: its cached core stores the matrices so, and they load as they are)
        capacities = {"context": context, "concurrency": concurrency, "kv_cache_mib": kv_cache_mib,
                      "prefill_chunk": prefill_chunk}
        path = resolve_core(core, cache_dir, "bfloat16" if quantization else "float32", capacities=capacities,
                            stored=quantization if stored else None)
        engine = OneShot.open(path, quantization=None if stored else quantization)
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



# -- the admin socket -----------------------------------------------------------------------------


class DaemonNotRunning(click.ClickException):
    """No daemon answers on the admin socket (exit code 3, like `systemctl status` for a stopped unit)."""

    exit_code = 3


class AdminClient:
    """HTTP/1.1 over the daemon's admin Unix socket, one connection per call."""

    def __init__(self, path: Path, timeout_s: float = 30.0):
        self.path = path
        self.timeout_s = timeout_s

    def call(self, method: str, target: str, *, timeout_s: float | None = None) -> tuple[int, bytes]:
        import http.client
        import socket

        path, t = str(self.path), timeout_s or self.timeout_s

        class _Conn(http.client.HTTPConnection):
            def connect(self):
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(t)
                self.sock.connect(path)

        conn = _Conn("localhost", timeout=t)
        try:
            conn.request(method, target, headers={"content-length": "0"} if method == "POST" else {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise DaemonNotRunning(
                f"flared is not running (no daemon answers on the admin socket {path}: {e.strerror}); "
                "start it with `flared run` or pass --admin-socket") from None
        except PermissionError:
            raise click.ClickException(f"permission denied on the admin socket {path} (run as the daemon's user)")
        finally:
            conn.close()

    def json(self, method: str, target: str, **kw) -> tuple[int, dict]:
        status, body = self.call(method, target, **kw)
        try:
            return status, json.loads(body)
        except ValueError:
            raise click.ClickException(f"unexpected answer from the daemon ({status}): {body[:200]!r}") from None


def _admin_option(f):
    def default_path() -> str:
        from flared.server.admin import default_admin_socket

        return str(default_admin_socket())
    return click.option("--admin-socket", "admin_socket", type=click.Path(path_type=Path), default=default_path,
                        show_default="$XDG_RUNTIME_DIR/flared/admin.sock, /run/flared/admin.sock as root",
                        help="The daemon's admin socket.")(f)


def _json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")(f)


def _print_status(body: dict) -> None:
    rt, http = body["runtime"], body["http"]
    c = rt["counters"]
    health = body.get("health", {})
    state = "paused" if http["paused"] else "serving"
    if not health.get("ok", True):
        state = f"unhealthy ({health.get('reason')})"
    lines = [
        ("state", state),
        ("model", body["model"]),
        ("listen", body.get("listen", "")),
        ("pid", body.get("pid", "")),
        ("uptime", f"{http['uptime_s']:.0f} s"),
        ("requests in flight", f"{http['permits_in_use']} of {http['permits']} permits"),
        ("model slots", f"{rt['live_slots']} live, {rt['pending_requests']} pending"),
        ("requests", f"{c.get('admitted', 0)} admitted, {c.get('finished', 0)} completed, "
                     f"{c.get('cancelled', 0)} cancelled, {rt['failed_requests']} failed"),
        ("tokens", f"{rt['prompt_tokens']} prompt computed, {rt['generated_tokens']} generated"),
        ("prefix cache", f"{c.get('prefix_hits', 0)} hits of {c.get('prefix_lookups', 0)} lookups, "
                         f"{c.get('prefix_reused_tokens', 0)} tokens reused"),
        ("kv pages", f"{rt['free_pages']} free of {rt['total_pages']}"),
    ]
    if "drained" in body:
        lines.append(("drained", "yes" if body["drained"] else "no (timed out)"))
    for k, v in lines:
        click.echo(f"{k + ':':<20}{v}")


def _echo_json(obj) -> None:
    click.echo(json.dumps(obj, separators=(",", ":")))


@main.group()
def cache():
    """The cores flared keeps in its cache: the embedded model's, and those of GGUF files and checkpoints served
    directly."""


_cache_dir_option = click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
                                 help="The cache (default ~/.cache/flared/cores, as flared run's).")


def _sized(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


@cache.command("list")
@_cache_dir_option
@_json_option
def cache_list(cache_dir, as_json):
    """Each cached core: its state (current; stale: its source changed since; orphaned: its source is gone; old:
    another flared's format or model release; unused: this machine serves its source from a core stored otherwise
    unless -q says; incomplete: an export cut short), size and source."""
    from flared.core.cache import cached_cores

    cores = cached_cores(cache_dir or default_cache_dir())
    if as_json:
        _echo_json({"cores": [c.to_dict() for c in cores], "size_bytes": sum(c.size_bytes for c in cores)})
        return
    for c in cores:
        click.echo(f"{c.state:10}  {_sized(c.size_bytes):>12}  {c.path.name}  ({c.source})")
    click.echo(f"{len(cores)} cores, {_sized(sum(c.size_bytes for c in cores))}")


@cache.command("prune")
@_cache_dir_option
@click.option("--unused", is_flag=True, help="Remove the unused ones too (those only a start with -q, or -q none, "
              "would serve here; exported again if asked for).")
@click.option("--all", "everything", is_flag=True, help="Remove every cached core, current ones too (they are "
              "exported again when next served).")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@_json_option
def cache_prune(cache_dir, unused, everything, dry_run, as_json):
    """Remove the cached cores no `flared run` would use as they are: stale, orphaned, old and incomplete ones."""
    from flared.core.cache import prune

    removed = prune(cache_dir or default_cache_dir(), unused=unused, everything=everything, dry_run=dry_run)
    freed = sum(c.size_bytes for c in removed)
    if as_json:
        _echo_json({"removed": [c.to_dict() for c in removed], "size_bytes": freed, "dry_run": dry_run})
        return
    for c in removed:
        click.echo(f"{'would remove' if dry_run else 'removed'} {c.path}  ({c.state}, {_sized(c.size_bytes)})")
    click.echo(f"{'would free' if dry_run else 'freed'} {_sized(freed)} ({len(removed)} cores)")


@main.command()
@_admin_option
@_json_option
def status(admin_socket, as_json):
    """Show the running daemon's state (the session snapshot)."""
    code, body = AdminClient(admin_socket).json("GET", "/admin/status")
    _echo_json(body) if as_json else _print_status(body)


@main.command()
@_admin_option
@_json_option
def models(admin_socket, as_json):
    """List the served model and its names and capacities."""
    code, body = AdminClient(admin_socket).json("GET", "/admin/models")
    if as_json:
        _echo_json(body)
        return
    caps = body["capacities"]
    click.echo(f"{body['model']}  ({body['architecture']}, {body['dtype']})")
    click.echo(f"  names:       {', '.join(body['served_names'])}")
    click.echo(f"  context:     {caps.get('context_tokens')} tokens, concurrency {caps.get('concurrency')}")
    click.echo(f"  core:        {body['core']}")
    weights = body.get("weights") or {}
    if weights.get("quantization"):
        formats = weights.get("formats") or {}
        mix = ("; " + ", ".join(f"{n} {fmt}" for fmt, n in sorted(formats.items(), key=lambda kv: -kv[1]))
               if len(formats) > 1 else "")  # (--quantization gguf: each matrix in its own)
        click.echo(f"  weights:     {weights['quantization']} ({weights['quantized_products']} of "
                   f"{weights['products']} products{mix}), {weights['product_bytes'] / 2**20:,.1f} MiB")
    kv = body.get("kv_cache") or {}
    if kv:
        click.echo(f"  kv cache:    {kv['dtype']}, {kv['pages']:,} pages, {kv['bytes'] / 2**20:,.1f} MiB")
    for adapter in body.get("lora_adapters", []):
        click.echo(f"  lora:        {adapter['path']} (scale {adapter['scale']:g})")


@main.command()
@_admin_option
@_json_option
def pause(admin_socket, as_json):
    """Stop admitting generation requests (they get 503); admitted ones finish."""
    code, body = AdminClient(admin_socket).json("POST", "/admin/pause")
    _echo_json(body) if as_json else click.echo("admission paused: new generation requests get 503")


@main.command()
@_admin_option
@_json_option
def resume(admin_socket, as_json):
    """Admit generation requests again."""
    code, body = AdminClient(admin_socket).json("POST", "/admin/resume")
    if code != 200:
        raise click.ClickException(body.get("error", {}).get("message", f"resume failed ({code})"))
    _echo_json(body) if as_json else click.echo("admission resumed")


@main.command()
@_admin_option
@_json_option
@click.option("--timeout", "timeout_s", type=float, default=30.0, show_default=True,
              help="Seconds to wait for admitted requests.")
def drain(admin_socket, as_json, timeout_s):
    """Pause admission and wait until admitted requests finish (exit 1 on timeout).

    Admission stays paused afterwards; `flarectl resume` reopens it."""
    code, body = AdminClient(admin_socket).json("POST", f"/admin/drain?timeout={timeout_s}",
                                                timeout_s=timeout_s + 10)
    if as_json:
        _echo_json(body)
    elif body.get("drained"):
        click.echo("drained: no admitted requests remain (admission paused)")
    else:
        click.echo(f"timed out after {timeout_s:g} s: {body['http']['permits_in_use']} requests still in flight")
    sys.exit(0 if body.get("drained") else 1)


@main.command()
@_admin_option
def metrics(admin_socket):
    """Print the Prometheus metrics text."""
    code, body = AdminClient(admin_socket).call("GET", "/metrics")
    click.echo(body.decode(), nl=False)


@main.command()
@_admin_option
def top(admin_socket):
    """The terminal dashboard against a running daemon (q or Ctrl-C quits)."""
    import threading

    from flared.dashboard.app import DashboardSourceError, run_curses

    client = AdminClient(admin_socket, timeout_s=5.0)
    client.json("GET", "/admin/status")  # fail with the clear message before curses takes the screen

    def poll(since: int) -> dict:
        code, body = client.json("GET", f"/admin/top?since={since}")
        return body

    try:
        run_curses(poll, threading.Event(), local=False)
    except KeyboardInterrupt:
        pass
    except DashboardSourceError as e:
        raise click.ClickException(f"lost the daemon: {e}") from None


from flared.bench.cli import bench as _bench  # noqa: E402  (a client tool; imports no daemon code)

main.add_command(_bench)

from flared.cli.chat import chat as _chat  # noqa: E402  (a client of the HTTP API only)

main.add_command(_chat)


if __name__ == "__main__":
    main()
