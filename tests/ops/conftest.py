"""Operations tests: a real `flared run` subprocess with an admin socket.

``OpsDaemon`` starts the daemon on 127.0.0.1:0 with an admin socket in the
test's directory and waits for its port file (written once the listener and
the admin socket are bound).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from flared_testing.daemon import Daemon, flarectl

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


class OpsDaemon(Daemon):
    """The shared Daemon with its admin socket in the test's directory."""

    def __init__(self, core: Path, tmp: Path, *args: str, admin: bool = True, **kw):
        super().__init__(core, tmp, *args, admin_socket=admin, **kw)


@pytest.fixture(scope="session")
def ops_daemon_cls():
    """OpsDaemon, for tests that start their own (conftest modules are not importable)."""
    return OpsDaemon


@pytest.fixture(scope="session")
def run_flarectl():
    return flarectl


@pytest.fixture(scope="module")
def ops_daemon(tiny_core, tmp_path_factory):
    d = OpsDaemon(tiny_core, tmp_path_factory.mktemp("ops"))
    yield d
    d.kill()
