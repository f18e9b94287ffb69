"""systemd units: `systemd-analyze verify` must print nothing, and the controller (and agent) must be
hardened to an exposure <= 2.5 (the engine template, which needs the GPUs, <= 2.0; it was 4.1) by
`systemd-analyze security --offline=yes`.

The units reference /opt/fleetplan/venv/bin/...; verify checks that ExecStart binaries exist, so the
test rewrites that prefix to this checkout's venv (the only change) before verifying.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNITS_DIR = REPO / "systemd"
UNITS = ("fleetplan-controller.service", "fleetplan-agent.service", "fleetplan-engine@.service")
INSTALL_PREFIX = "/opt/fleetplan/venv/bin/"
ANALYZE = shutil.which("systemd-analyze")

pytestmark = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze not installed (Debian: apt-get install systemd)"
)


def _localised(tmp_path: Path, name: str, text: str | None = None) -> Path:
    bindir = Path(sys.executable).parent
    assert (bindir / "fleetplan").exists(), f"{bindir}/fleetplan missing: pip install -e ."
    unit = tmp_path / name
    unit.write_text((text or (UNITS_DIR / name).read_text()).replace(INSTALL_PREFIX, f"{bindir}/"))
    return unit


def _verify(unit: Path) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    return subprocess.run([ANALYZE, "verify", str(unit)], capture_output=True, text=True, timeout=60,
                          cwd=unit.parent, check=False)


def _exposure(unit: Path) -> float:
    assert ANALYZE is not None
    out = subprocess.run([ANALYZE, "security", "--offline=yes", str(unit)], capture_output=True, text=True,
                         timeout=60, cwd=unit.parent, check=False)
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out.stdout)
    assert found, f"no exposure level in: {out.stdout[-500:]} {out.stderr[-500:]}"
    return float(found.group(1))


@pytest.mark.parametrize("name", UNITS)
def test_unit_verifies_without_any_message(tmp_path: Path, name: str) -> None:
    result = _verify(_localised(tmp_path, name))
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr


def test_verify_check_catches_a_broken_unit(tmp_path: Path) -> None:
    text = (UNITS_DIR / "fleetplan-controller.service").read_text().replace("Type=notify", "Tpye=notify")
    result = _verify(_localised(tmp_path, "broken.service", text))
    assert "Tpye" in result.stderr


@pytest.mark.parametrize(("name", "limit"), [("fleetplan-controller.service", 2.5),
                                             ("fleetplan-agent.service", 2.5),
                                             ("fleetplan-engine@.service", 2.0)])
def test_security_exposure_within_limit(tmp_path: Path, name: str, limit: float) -> None:
    exposure = _exposure(_localised(tmp_path, name))
    print(f"{name}: exposure {exposure}")
    assert exposure <= limit


def test_security_check_sees_an_unhardened_unit(tmp_path: Path) -> None:
    text = "[Service]\nType=notify\nExecStart=/opt/fleetplan/venv/bin/fleetplan controller\n"
    assert _exposure(_localised(tmp_path, "bare.service", text)) > 5.0


def test_controller_unit_contract() -> None:
    text = (UNITS_DIR / "fleetplan-controller.service").read_text()
    for line in ("Type=notify", "ExecReload=/bin/kill -HUP $MAINPID", "NoNewPrivileges=yes"):
        assert f"\n{line}\n" in text, line
    assert re.search(r"^WatchdogSec=\d+", text, re.M)


def test_engine_template_reads_the_per_instance_environment_file() -> None:
    text = (UNITS_DIR / "fleetplan-engine@.service").read_text()
    assert "\nEnvironmentFile=/etc/fleetplan/engines/%i.env\n" in text
    assert "\nExecStart=/opt/fleetplan/venv/bin/python -m fleetplan.controller.actuators exec\n" in text
    assert "\nRestart=no\n" in text


def _settings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


def test_engine_template_is_confined_to_the_gpus_and_a_syscall_filter() -> None:
    s = _settings((UNITS_DIR / "fleetplan-engine@.service").read_text())
    assert s["DevicePolicy"] == ["closed"]
    assert {"/dev/nvidiactl rw", "/dev/nvidia-uvm rw", "char-nvidia-frontend rw"} <= set(s["DeviceAllow"])
    assert s["SystemCallFilter"][0].split()[0] == "@system-service" and "~@privileged" in s["SystemCallFilter"]
    assert s["SystemCallErrorNumber"] == ["EPERM"]  # a filtered call fails, it does not kill the engine
    for key, value in [("ProtectSystem", "strict"), ("ProtectHome", "yes"), ("NoNewPrivileges", "yes"),
                       ("CapabilityBoundingSet", ""), ("ProtectProc", "invisible"), ("PrivateMounts", "yes")]:
        assert s[key] == [value], key
    # what an engine needs stays: the GPUs (no PrivateDevices), CPU JIT (no MemoryDenyWriteExecute),
    # the NVIDIA /proc files (no ProcSubset=pid), the /dev/shm of the other engines of the same user
    # (no RemoveIPC), netlink for NCCL's interface discovery
    for key in ("PrivateDevices", "MemoryDenyWriteExecute", "ProcSubset", "RemoveIPC", "PrivateNetwork"):
        assert key not in s, key
    assert "AF_NETLINK" in s["RestrictAddressFamilies"][0].split()
