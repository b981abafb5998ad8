"""Daemons for the structured-output and decisions tests.

The ``Daemon`` helper is tests/daemon/conftest.py's (loaded by path: conftest
modules are not importable), so these tests start ``flared run`` exactly as
the daemon tests do.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("_daemon_helper", Path(__file__).parent.parent / "daemon" / "conftest.py")
_helper = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helper)
Daemon = _helper.Daemon


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("structured")


@pytest.fixture(scope="module")
def smol_daemon(default_core, module_tmp):
    d = Daemon(default_core, module_tmp, "--threads", "2")
    yield d
    d.kill()


@pytest.fixture(scope="module")
def tiny_daemon(tiny_core, module_tmp):
    d = Daemon(tiny_core, module_tmp)
    yield d
    d.kill()
