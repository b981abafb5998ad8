"""The systemd unit and its snippets: `systemd-analyze verify` where it exists, plus the promises we rely on."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "flared.service"


def _service() -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    section = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        values.setdefault(f"{section}.{key}", []).append(value)
    return values


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path):
    # verify checks that ExecStart exists: point it at this checkout's flared.
    flared = Path(sys.executable).parent / "flared"
    unit = tmp_path / "flared.service"
    unit.write_text(UNIT.read_text().replace("/usr/bin/flared", str(flared)))
    res = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # It exits 0 even for unknown keys or bad values and only prints them.
    assert res.returncode == 0 and not res.stderr.strip() and not res.stdout.strip(), res.stderr


def test_unit_promises():
    v = _service()
    assert v["Service.Type"] == ["notify"]
    assert v["Service.Restart"] == ["on-failure"]
    assert v["Service.LimitMEMLOCK"] == ["infinity"]
    # Stop timeout covers the 5 s HTTP grace plus the model drain.
    assert int(v["Service.TimeoutStopSec"][0]) > 5 + 10
    assert int(v["Service.WatchdogSec"][0]) > 0
    for key in ("RuntimeDirectory", "StateDirectory", "CacheDirectory", "User"):
        assert v[f"Service.{key}"] == ["flared"], key
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert v[f"Service.{key}"] == ["yes"], key
    assert v["Service.ProtectSystem"] == ["strict"]
    assert any("nvidiactl" in d for d in v["Service.DeviceAllow"])
    assert "--no-dashboard" in v["Service.ExecStart"][0] and "/etc/flared/flared.toml" in v["Service.ExecStart"][0]


def test_sysusers_and_tmpfiles_lines_are_well_formed():
    for line in (REPO / "systemd" / "flared.sysusers.conf").read_text().splitlines():
        if line and not line.startswith("#"):
            assert line.split()[0] in ("u", "g", "m", "r"), line
    for line in (REPO / "systemd" / "flared.tmpfiles.conf").read_text().splitlines():
        if line and not line.startswith("#"):
            fields = line.split()
            assert fields[0] == "d" and fields[1].startswith("/") and len(fields[2]) == 4, line
