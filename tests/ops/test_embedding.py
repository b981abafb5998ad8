"""The docs/embedding.md example, run as written against the tiny core."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_embedding_example_runs_as_documented(tiny_core, tmp_path):
    doc = (REPO / "docs" / "embedding.md").read_text()
    script = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    (tmp_path / "embed.py").write_text(script)
    res = subprocess.run([sys.executable, str(tmp_path / "embed.py"), str(tiny_core)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""  # an embedded session writes nothing to the terminal
    out = res.stdout.splitlines()
    assert out[0] == "after load: loading frontend"
    assert out[1] == "after start: ready"
    assert re.fullmatch(r"chat: 200 \d+ tokens", out[2])
    assert out[3] == "snapshot: 1 1 finished, 6 permits"
    assert out[4:] == ["while paused: 503", "drained: True", "after resume: 200", "closed"]


def test_startup_progress_is_bounded_and_pushes(tiny_core):
    from flared.config import ServerConfig
    from flared.runtime.session import LoadedSession, StartupProgress

    progress = StartupProgress()
    seen = []
    progress.subscribe(seen.append)
    assert progress.observed is None
    LoadedSession.load(tiny_core, ServerConfig(port=0), progress=progress)
    assert [s.stage for s in seen] == ["opening core", "loading frontend"]
    assert progress.observed == seen[-1]
    assert seen[0].monotonic_ns <= seen[1].monotonic_ns
