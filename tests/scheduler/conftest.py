import os

import pytest


def pytest_collection_modifyitems(config, items):
    # Long variants run only when asked for (CI has a shared 25-minute budget).
    if os.environ.get("FLARED_SLOW_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="slow variant: set FLARED_SLOW_TESTS=1")
    for item in items:
        if "slow" in item.keywords and str(item.fspath).startswith(os.path.dirname(__file__)):
            item.add_marker(skip)
