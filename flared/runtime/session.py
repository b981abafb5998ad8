"""Embedding API: load a core, start serving, observe, pause, close.

    session = LoadedSession.load("/path/to/core", ServerConfig(port=0))
    serving = await session.start()          # model thread + HTTP listener
    serving.address                          # ("127.0.0.1", 43125)
    serving.snapshot()                       # runtime and HTTP gauges
    serving.pause_admission(); await serving.wait_for_requests(10); serving.resume_admission()
    await serving.close()                    # grace period, drain, release

``flared run`` is this plus signal handling. The session imports the server
layer lazily: it is the one place that ties the whole stack together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from pathlib import Path

from flared.core.load import Core, open_core

_session_ids = itertools.count(1)


@dataclasses.dataclass
class LoadedSession:
    core: Core
    config: "ServerConfig"  # noqa: F821
    frontend: object
    runtime: object  # flared.runtime.worker.ModelRuntime, not yet started

    @property
    def manifest(self):
        return self.core.manifest

    @classmethod
    def load(cls, core_path: str | Path, config, *, fail_after_steps: int | None = None) -> "LoadedSession":
        from flared.frontend import Frontend, TokenSettings
        from flared.runtime.worker import ModelRuntime

        core = open_core(core_path)
        m = core.manifest
        if config.served_names:
            m = dataclasses.replace(m, served_names=tuple(dict.fromkeys((*m.served_names, *config.served_names))))
            core = dataclasses.replace(core, manifest=m)
        t = m.tokens
        settings = TokenSettings(
            bos_token=t.bos_token if t.bos_token_id is not None else None,
            bos_token_id=t.bos_token_id if t.bos_token is not None else None,
            eos_token=t.eos_token, eos_token_id=t.eos_token_ids[0] if t.eos_token else None,
            add_bos_token=t.add_bos_token)
        template = core.path / m.chat_template if m.chat_template else None
        frontend = Frontend.load(
            core.tokenizer_path, template,
            tokenizer_sha256=m.assets[m.tokenizer].sha256,
            template_sha256=m.assets[m.chat_template].sha256 if m.chat_template else None,
            settings=settings)
        runtime = ModelRuntime(core, prefix_cache=config.prefix_cache, torch_threads=config.torch_threads,
                               fail_after_steps=fail_after_steps)
        return cls(core=core, config=config, frontend=frontend, runtime=runtime)

    async def start(self) -> "ServingSession":
        from flared.server.app import ServingState, build_router, http_config
        from flared.server.http import HttpServer

        m = self.manifest
        max_active = self.config.max_active or m.capacities.concurrency
        queue = self.config.queue_capacity if self.config.queue_capacity is not None else 4 * max_active
        self.runtime.start(max_pending=queue + max_active)
        state = ServingState(m, self.frontend, self.runtime, frontend_workers=self.config.frontend_workers,
                             http_permits=queue + max_active)
        server = HttpServer(build_router(state), http_config(self.config, m), admission=state.admit)
        try:
            await server.start()
        except BaseException:
            self.runtime.stop()
            state.close()
            raise
        return ServingSession(self, state, server)


class ServingSession:
    def __init__(self, loaded: LoadedSession, state, server):
        self.session_id = next(_session_ids)
        self.loaded = loaded
        self.state = state
        self.server = server
        self._closed = False

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

    def snapshot(self) -> dict:
        """Runtime and HTTP gauges; counters are read independently (not one transaction)."""
        rt = self.loaded.runtime.snapshot()
        return {
            "session_id": self.session_id,
            "sample_monotonic_ns": time.monotonic_ns(),
            "model": self.loaded.manifest.model_name,
            "runtime": rt,
            "http": {
                "permits": self.state.http_permits,
                "permits_in_use": self.state.http_in_use,
                "frontend_workers": self.state.frontend_workers,
                "frontend_busy": self.state.frontend_busy,
                "paused": self.state.paused,
                "uptime_s": self.server.uptime_s,
            },
        }

    def pause_admission(self) -> None:
        self.state.paused = True

    def resume_admission(self) -> None:
        if self.loaded.runtime.failed.is_set():
            raise RuntimeError("cannot resume: the model thread has failed")
        self.state.paused = False

    async def wait_for_requests(self, timeout_s: float) -> bool:
        """Wait until no admitted request remains; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.state.http_in_use > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def close(self, grace_s: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self.state.paused = True
        await self.server.close(grace_s)
        await asyncio.get_running_loop().run_in_executor(None, self.loaded.runtime.stop)
        self.state.close()
