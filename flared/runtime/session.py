"""Embedding API: load a core, start serving, observe, pause, close.

    session = LoadedSession.load("/path/to/core", ServerConfig(port=0))
    serving = await session.start()          # model thread + HTTP listener
    serving.address                          # ("127.0.0.1", 43125)
    serving.snapshot()                       # SessionSnapshot: runtime and HTTP gauges
    serving.pause_admission(); await serving.wait_for_requests(10); serving.resume_admission()
    await serving.close()                    # grace period, drain, release

``flared run`` is this plus signal handling, the admin socket and the
dashboard. The session imports the server layer lazily: it is the one place
that ties the whole stack together. Loading writes nothing to the terminal;
``StartupProgress.observed`` gives the latest stage to whoever asks
(``flared run`` forwards it to systemd as STATUS=).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

from flared.core.load import Core, open_core

_session_ids = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class StartupStage:
    stage: str  # "opening core", "loading frontend", "loading weights", "binding listener", "ready"
    detail: str
    monotonic_ns: int


class StartupProgress:
    """The latest startup stage, bounded to one entry; safe from any thread.

    Listeners (e.g. sd_notify STATUS=) are called on the reporting thread and
    must not block."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest: StartupStage | None = None
        self._listeners: list = []

    @property
    def observed(self) -> StartupStage | None:
        with self._lock:
            return self._latest

    def subscribe(self, listener) -> None:
        self._listeners.append(listener)

    def report(self, stage: str, detail: str = "") -> None:
        entry = StartupStage(stage, detail, time.monotonic_ns())
        with self._lock:
            self._latest = entry
        for listener in list(self._listeners):
            listener(entry)


@dataclasses.dataclass(frozen=True)
class RuntimeGauges:
    steps: int
    pending_requests: int
    outstanding_requests: int
    failed: bool
    live_slots: int
    free_pages: int
    total_pages: int
    free_snapshots: int
    prompt_tokens: int
    generated_tokens: int
    failed_requests: int
    counters: dict  # the scheduler's counters (admitted, finished, cancelled, prefix_*, launches_*, ...)


@dataclasses.dataclass(frozen=True)
class HttpGauges:
    permits: int
    permits_in_use: int
    frontend_workers: int
    frontend_busy: int
    paused: bool
    uptime_s: float


@dataclasses.dataclass(frozen=True)
class SessionSnapshot:
    """Independently read gauges: not one transaction (a model step may run between reads)."""
    session_id: int
    sample_monotonic_ns: int
    model: str
    runtime: RuntimeGauges
    http: HttpGauges

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        # The older dict form's key names, kept for callers that index it.
        d["runtime"]["pending"] = d["runtime"]["pending_requests"]
        d["runtime"]["outstanding"] = d["runtime"]["outstanding_requests"]
        return d

    def __getitem__(self, key: str):
        return self.to_dict()[key]


@dataclasses.dataclass
class LoadedSession:
    core: Core
    config: "ServerConfig"  # noqa: F821
    frontend: object
    runtime: object  # flared.runtime.worker.ModelRuntime, not yet started

    @property
    def manifest(self):
        return self.core.manifest

    progress: StartupProgress = dataclasses.field(default_factory=StartupProgress)

    @classmethod
    def load(cls, core_path: str | Path, config, *, fail_after_steps: int | None = None,
             progress: StartupProgress | None = None) -> "LoadedSession":
        from flared.frontend import Frontend, TokenSettings
        from flared.runtime.worker import ModelRuntime

        progress = progress or StartupProgress()
        config = config.with_secrets()
        progress.report("opening core", str(core_path))
        core = open_core(core_path)
        m = core.manifest
        if config.served_names or config.served_model_name:  # (the first name is the model's: its card's id)
            first = (config.served_model_name,) if config.served_model_name else ()
            m = dataclasses.replace(m, served_names=tuple(dict.fromkeys(
                (*first, *m.served_names, *config.served_names))))
            core = dataclasses.replace(core, manifest=m)
        from flared.server.openai_routes import names_served_model

        taken = [name for name, _ in config.lora_modules if names_served_model(m, name)]
        if taken:
            from flared.config import ConfigError

            raise ConfigError(f"config key 'lora_modules': {taken[0]!r} already names the served model; give the "
                              f"adapter a name of its own")
        t = m.tokens
        settings = TokenSettings(
            bos_token=t.bos_token if t.bos_token_id is not None else None,
            bos_token_id=t.bos_token_id if t.bos_token is not None else None,
            eos_token=t.eos_token, eos_token_id=t.eos_token_ids[0] if t.eos_token else None,
            add_bos_token=t.add_bos_token)
        template = core.path / m.chat_template if m.chat_template else None
        template_sha256 = m.assets[m.chat_template].sha256 if m.chat_template else None
        progress.report("loading frontend", m.model_name)
        with _served_template(config.chat_template) as override:
            if override is not None:  # the operator's template in place of the core's (no digest to check)
                template, template_sha256 = override, None
            frontend = Frontend.load(core.tokenizer_path, template, tokenizer_sha256=m.assets[m.tokenizer].sha256,
                                     template_sha256=template_sha256, settings=settings)
        draft = None
        if config.speculative_model is not None:
            progress.report("opening draft core", str(config.speculative_model))
            draft = open_core(config.speculative_model)
            _check_draft_vocabulary(core, draft)
        runtime = ModelRuntime(core, prefix_cache=config.prefix_cache, torch_threads=config.torch_threads,
                               fail_after_steps=fail_after_steps, lora_adapters=config.lora_adapters,
                               lora_modules=config.lora_modules,
                               lora_slots=config.max_loras if config.runtime_lora_updating else None,
                               max_lora_rank=config.max_lora_rank,
                               max_cpu_loras=config.max_cpu_loras if config.runtime_lora_updating else None,
                               kv_cache_dtype=config.kv_cache_dtype, enforce_eager=config.enforce_eager,
                               quantization=config.quantization,
                               speculative=(config.speculative_tokens, config.prompt_lookup_max,
                                            config.prompt_lookup_min),
                               draft_core=draft, draft_p_min=config.draft_p_min,
                               draft_kv_tokens=config.draft_kv_tokens,
                               **_policy_kwargs(config))
        return cls(core=core, config=config, frontend=frontend, runtime=runtime, progress=progress)

    async def start(self) -> "ServingSession":
        from flared.server.app import ServingState, build_router, http_config
        from flared.server.http import HttpServer

        from flared.server.media import MediaFetcher
        from flared.server.metrics import ServerMetrics

        m = self.manifest
        max_active = self.config.max_active or m.capacities.concurrency
        queue = self.config.queue_capacity if self.config.queue_capacity is not None else 4 * max_active
        self.progress.report("loading weights", f"{m.model_name} ({m.dtype})")
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.runtime.start(max_pending=queue + max_active))
        state = ServingState(m, self.frontend, self.runtime, frontend_workers=self.config.frontend_workers,
                             http_permits=queue + max_active)
        state.metrics = ServerMetrics(self.runtime, state, max_slots=m.capacities.concurrency)
        state.tool_parser, state.reasoning_parser = self.config.tool_parser, self.config.reasoning_parser
        state.lora_modules = {name: (k + 1, path) for k, (name, path) in enumerate(self.config.lora_modules)}
        state.runtime_lora_updating = self.config.runtime_lora_updating
        state.embedding_pooling = self.config.embedding_pooling
        state.trust_request_chat_template = self.config.trust_request_chat_template
        state.media = MediaFetcher(fetch_remote=self.config.media_fetch,
                                   allowed_domains=tuple(d.lower() for d in self.config.allowed_media_domains),
                                   local_root=self.config.allowed_local_media_path,
                                   timeout_s=self.config.media_fetch_timeout_s)
        state.max_images = self.config.max_images_per_request
        state.web_ui = self.config.web_ui
        state.scheme = "https" if self.config.ssl_certfile else "http"
        server = HttpServer(build_router(state), http_config(self.config, m), admission=state.admit)
        self.progress.report("binding listener", f"{self.config.host}:{self.config.port}")
        admin = None
        try:
            await server.start()
            state.metrics.set_uptime_source(lambda: server.uptime_s)
            state.metrics.start()
            serving = ServingSession(self, state, server)
            if self.config.admin_socket:
                admin = await serving.start_admin(self.config.admin_socket)
        except BaseException:
            if admin is not None:
                await admin.close(0)
            state.metrics.stop()
            await server.close(0)
            self.runtime.stop()
            state.close()
            raise
        host, port = server.address
        self.progress.report("ready", f"listening on {host}:{port}")
        return serving


def _check_draft_vocabulary(core: Core, draft: Core) -> None:
    """A draft model must number the served model's tokens as it does (its drafts are token ids): every id both
    tokenizers have is the same token, and their model vocabularies differ by at most 128 ids (padding), as
    llama.cpp's server asks of a --model-draft. ConfigError naming the first id that differs."""
    from tokenizers import Tokenizer

    from flared.config import ConfigError

    served, drafting = core.config.vocab_size, draft.config.vocab_size
    if abs(served - drafting) > 128:
        raise ConfigError(f"config key 'speculative_model': the draft model has {drafting} token ids and the served "
                          f"model {served}: a draft model must share the served model's vocabulary")

    def tokens(c: Core) -> dict[int, str]:
        return {i: t for t, i in Tokenizer.from_file(str(c.tokenizer_path)).get_vocab(with_added_tokens=True).items()}

    a, b = tokens(core), tokens(draft)
    for i in sorted(set(a) & set(b)):
        if a[i] != b[i]:
            raise ConfigError(f"config key 'speculative_model': token {i} is {b[i]!r} to the draft model and "
                              f"{a[i]!r} to the served model: a draft model must share the served model's "
                              "vocabulary")


def _policy_kwargs(config) -> dict:
    policy = getattr(config, "policy", None)
    return {"policy": policy} if policy is not None else {}


class ServingSession:
    def __init__(self, loaded: LoadedSession, state, server):
        self.session_id = next(_session_ids)
        self.loaded = loaded
        self.state = state
        self.server = server
        self._closed = False
        self.admin = None  # the admin socket's HttpServer, when started
        self.admin_path: str | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    @property
    def failure(self) -> BaseException | None:
        return self.loaded.runtime.failure

    async def wait_failed(self) -> BaseException | None:
        """Returns the model thread's failure when it happens (polls a thread event)."""
        rt = self.loaded.runtime
        while not rt.failed.is_set():
            await asyncio.get_running_loop().run_in_executor(None, rt.failed.wait, 1.0)
        return rt.failure

    @property
    def metrics(self):
        return self.state.metrics

    def snapshot(self) -> SessionSnapshot:
        """Runtime and HTTP gauges; counters are read independently (not one transaction)."""
        rt = self.loaded.runtime.snapshot()
        st = self.state
        return SessionSnapshot(
            session_id=self.session_id,
            sample_monotonic_ns=time.monotonic_ns(),
            model=self.loaded.manifest.model_name,
            runtime=RuntimeGauges(
                steps=rt.get("steps", 0), pending_requests=rt.get("pending", 0),
                outstanding_requests=rt.get("outstanding", 0), failed=bool(rt.get("failed", False)),
                live_slots=rt.get("live_slots", 0), free_pages=rt.get("free_pages", 0),
                total_pages=rt.get("total_pages", 0), free_snapshots=rt.get("free_snapshots", 0),
                prompt_tokens=rt.get("prompt_tokens", 0), generated_tokens=rt.get("generated_tokens", 0),
                failed_requests=rt.get("failed_requests", 0), counters=dict(rt.get("counters", {}))),
            http=HttpGauges(permits=st.http_permits, permits_in_use=st.http_in_use,
                            frontend_workers=st.frontend_workers, frontend_busy=st.frontend_busy,
                            paused=st.paused, uptime_s=self.server.uptime_s),
        )

    async def start_admin(self, path: str | Path):
        """Serve the admin routes on a Unix socket at ``path`` (mode 0600)."""
        from flared.server.admin import build_admin_router
        from flared.server.http import HttpConfig, HttpServer

        sock = bind_admin_socket(Path(path), group=self.loaded.config.admin_socket_group)
        server = HttpServer(build_admin_router(self), HttpConfig(host="127.0.0.1", port=0, max_connections=64))
        try:
            await server.start(sock=sock)
        except BaseException:
            sock.close()
            raise
        self.admin = server
        self.admin_path = str(path)
        return server

    def pause_admission(self) -> None:
        self.state.paused = True

    def resume_admission(self) -> None:
        if self.loaded.runtime.failed.is_set():
            raise RuntimeError("cannot resume: the model thread has failed")
        self.state.paused = False

    async def wait_for_requests(self, timeout_s: float) -> bool:
        """Wait until no admitted request remains; False on timeout.

        Woken by the permit release of the last admitted response, not polled."""
        if self.state.http_in_use == 0:
            return True
        fut = asyncio.get_running_loop().create_future()
        self.state.idle_waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            return self.state.http_in_use == 0
        finally:
            if fut in self.state.idle_waiters:
                self.state.idle_waiters.remove(fut)
        return True

    async def close(self, grace_s: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self.state.paused = True
        await self.server.close(grace_s)
        await asyncio.get_running_loop().run_in_executor(None, self.loaded.runtime.stop)
        if self.state.metrics is not None:
            self.state.metrics.stop()
        if self.admin is not None:
            await self.admin.close(0.5)
            _unlink_quietly(self.admin_path)
        self.state.close()


@contextlib.contextmanager
def _served_template(value: str | None):
    """ServerConfig.chat_template as a file the frontend can load: the path itself, or the template text (the
    config checked it is one) in a temporary file, removed once loaded; None where none replaces the core's."""
    if value is None:
        yield None
        return
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # a template's text can be too long to be a path
        is_file = False
    if is_file:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="flared-template-") as tmp:
        inline = Path(tmp) / "chat_template.jinja"
        inline.write_text(value, encoding="utf-8")
        yield inline


def bind_admin_socket(path: Path, group: str | None = None) -> socket.socket:
    """A listening Unix socket at ``path``, mode 0600 (0660 owned by
    ``group`` when given), in a 0700 directory when we create it. A stale
    socket file (nobody listening) is replaced; a live one is an error, so
    two daemons never share an admin socket."""
    gid = -1
    if group is not None:
        import grp

        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise OSError(f"admin socket group {group!r} does not exist") from None
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()
        else:
            raise OSError(f"admin socket {path} is in use by another running daemon")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # umask first: between bind and chmod nobody else may connect.
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    if gid >= 0:
        os.chown(path, -1, gid)
        os.chmod(path, 0o660)
    else:
        os.chmod(path, 0o600)
    sock.listen(64)
    sock.setblocking(False)
    return sock


def _unlink_quietly(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass
