"""Daemon tests: a real `flared run` subprocess (tests/flared_testing/daemon.py)."""

from __future__ import annotations

import pytest
from flared_testing.daemon import Daemon


@pytest.fixture(scope="session")
def daemon_cls():
    """The Daemon class, for module-scoped daemons (or import it: from flared_testing.daemon import Daemon)."""
    return Daemon
