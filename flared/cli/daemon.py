"""`flared`: the serving daemon.

`flared run [CORE]` loads a core (the embedded default model when CORE is
omitted), starts the model thread, and serves HTTP until SIGTERM/SIGINT:
then it stops admission (new generation requests get 503), gives admitted
responses the grace period, cancels the rest, drains the model thread and
exits 0. An unexpected model-thread failure sends every client an error and
exits 1.

Only this layer reads the environment (FLARED_API_KEY and click's
FLARED_* auto variables).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path

import click

from flared.errors import FlareError

log = logging.getLogger("flared")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "FLARED"})
@click.version_option(package_name="flared")
def main() -> None:
    """The flared LLM serving daemon."""


@main.command()
@click.argument("core", required=False)
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None, help="TOML config file.")
@click.option("--host", default=None, help="Address to bind (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port to bind (default 8000; 0 = ephemeral).")
@click.option("--port-file", default=None, help="Write the bound port to this file once listening.")
@click.option("--api-key", default=None, envvar="FLARED_API_KEY", help="Bearer token clients must send.")
@click.option("--queue-capacity", type=int, default=None, help="Requests that may wait beyond max-active.")
@click.option("--max-active", type=int, default=None, help="Requests admitted at once (default: the core's concurrency).")
@click.option("--frontend-workers", type=int, default=None, help="Template/tokenizer worker threads (default 2).")
@click.option("--served-name", "served_names", multiple=True, help="Extra model name clients may use.")
@click.option("--no-prefix-cache", is_flag=True, default=False, help="Disable prefix reuse.")
@click.option("--threads", "torch_threads", type=int, default=None, help="CPU threads for the model.")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None, help="Where the default core is cached.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None)
@click.option("--debug-fail-after-steps", type=int, default=None, hidden=True,
              help="Fault injection for tests: the model thread fails after N steps.")
def run(core, config_path, host, port, port_file, api_key, queue_capacity, max_active, frontend_workers,
        served_names, no_prefix_cache, torch_threads, cache_dir, log_level, debug_fail_after_steps):
    """Serve CORE (a core directory; omitted: the embedded default model)."""
    from flared.config import ServerConfig

    try:
        config = ServerConfig.from_toml(config_path) if config_path else ServerConfig()
        overrides = {k: v for k, v in dict(
            host=host, port=port, port_file=port_file, api_key=api_key, queue_capacity=queue_capacity,
            max_active=max_active, frontend_workers=frontend_workers, torch_threads=torch_threads,
            log_level=log_level).items() if v is not None}
        if served_names:
            overrides["served_names"] = tuple(served_names)
        if no_prefix_cache:
            overrides["prefix_cache"] = False
        config = dataclasses.replace(config, **overrides)
    except FlareError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if core is None:
            from flared.cli.ctl import default_cache_dir
            from flared.core.default import ensure_default_core

            core = ensure_default_core(cache_dir or default_cache_dir())
        code = serve(Path(core), config, fail_after_steps=debug_fail_after_steps)
    except FlareError as e:
        log.error("%s", e)
        sys.exit(1)
    sys.exit(code)


def serve(core_path: Path, config, *, fail_after_steps: int | None = None) -> int:
    """Load, serve until a signal or a model-thread failure; return the exit code."""
    from flared.runtime.session import LoadedSession

    session = LoadedSession.load(core_path, config, fail_after_steps=fail_after_steps)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    return runner(_serve_async(session))


async def _serve_async(session) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serving = await session.start()
    host, port = serving.address
    log.info("listening on http://%s:%d (model %s)", host, port, session.manifest.model_name)
    if session.config.port_file:
        _write_atomic(session.config.port_file, f"{port}\n")
    failed = asyncio.ensure_future(serving.wait_failed())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
    crashed = failed.done() and failed.result() is not None
    for t in (failed, stopped):
        t.cancel()
    if crashed:
        log.error("model thread failed: %s", serving.failure)
    else:
        log.info("shutting down: admission stopped, %.1fs grace for active responses",
                 session.config.shutdown_grace_s)
    await serving.close(grace_s=0.5 if crashed else session.config.shutdown_grace_s)
    return 1 if crashed else 0


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
