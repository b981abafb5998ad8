"""Daemon tests: a real `flared run` subprocess (tests/flared_testing/daemon.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from flared_testing.daemon import Daemon


@pytest.fixture
def start_daemon(tmp_path):
    started: list[Daemon] = []

    def start(core: Path, *args: str, **kw) -> Daemon:
        d = Daemon(core, tmp_path, *args, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()


@pytest.fixture(scope="session")
def daemon_cls():
    """The Daemon class, for module-scoped daemons (conftest modules are not importable)."""
    return Daemon
