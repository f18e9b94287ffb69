"""Issue 19, item 3: the token-less (loopback) report API refuses cross-site writes and foreign
Host names, on the real aiohttp server; `fleetplan pause/resume` (the CLI, a subprocess) keep
working; with a token, the token is the check, as before."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from fleetplan.controller.actuation import load_pause
from fleetplan.controller.daemon import Controller, ControllerSettings
from fleetplan.controller.report import start_report_server
from fleetplan.controller.state import StateStore

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[Controller, str]]:
    ctrl = Controller(settings=ControllerSettings(report_hosts=("fleet-ctl.internal",)),
                      policy_path=tmp_path / "policy.yaml", profiles_path=None, store=StateStore(tmp_path / "s.db"))
    runner, url = await start_report_server(ctrl, "127.0.0.1:0", None)
    try:
        yield ctrl, url
    finally:
        await runner.cleanup()
        await ctrl.prom.aclose()
        ctrl.store.close()


async def test_a_cross_site_pause_is_refused_and_the_fleet_stays_unpaused(api: tuple[Controller, str]) -> None:
    ctrl, url = api
    port = url.rsplit(":", 1)[1]
    async with httpx.AsyncClient(timeout=5) as c:
        # what a browser sends from any page: a form-like text/plain POST with the page's origin
        r = await c.post(url + "/api/pause", content=b"{}", headers={"Origin": "https://evil.example",
                                                                    "Content-Type": "text/plain"})
        assert r.status_code == 403, r.text
        # the same with JSON or the header, but the foreign origin: still refused
        r = await c.post(url + "/api/pause", json={}, headers={"Origin": "https://evil.example"})
        assert r.status_code == 403 and "Origin" in r.json()["error"]
        r = await c.post(url + "/api/pause", headers={"Origin": "null", "X-Fleetplan-Request": "1"})
        assert r.status_code == 403
        r = await c.post(url + "/api/pause", json={}, headers={"Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 403
        # a plain form-encoded / bodyless POST without the header: refused (curl -X POST as well)
        r = await c.post(url + "/api/pause", data={"reason": "x"})
        assert r.status_code == 403 and "X-Fleetplan-Request" in r.json()["error"]
        r = await c.post(url + "/api/resume")
        assert r.status_code == 403
        assert not load_pause(ctrl.store).paused and not ctrl.pause.paused

        # DNS rebinding: attacker.example resolved to 127.0.0.1 reads nothing, writes nothing
        for path in ("/api/report", "/api/state", "/plan", "/metrics"):
            r = await c.get(url + path, headers={"Host": f"attacker.example:{port}"})
            assert r.status_code == 403 and "Host" in r.json()["error"], (path, r.text)
        r = await c.post(url + "/api/pause", json={}, headers={"Host": f"attacker.example:{port}"})
        assert r.status_code == 403
        assert (await c.get(url + "/healthz", headers={"Host": "attacker.example"})).status_code in (200, 503)

        # this machine's own requests: JSON body, or the header; the own origin; loopback names,
        # any port (an SSH tunnel's local port); a configured name
        r = await c.post(url + "/api/pause", json={"reason": "disk on h3"},
                         headers={"Origin": f"http://127.0.0.1:{port}"})
        assert r.status_code == 200 and r.json()["paused"] is True
        r = await c.post(url + "/api/resume", headers={"X-Fleetplan-Request": "1", "Host": "localhost:8080",
                                                        "Origin": "http://localhost:8080"})
        assert r.status_code == 200 and r.json()["paused"] is False, r.text
        r = await c.get(url + "/api/report", headers={"Host": "fleet-ctl.internal:9470"})
        assert r.status_code != 403
        r = await c.get(url + "/api/report", headers={"Host": f"[::1]:{port}"})
        assert r.status_code != 403


async def test_fleetplan_pause_and_resume_keep_working(api: tuple[Controller, str]) -> None:
    ctrl, url = api

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fleetplan", *args, "--url", url], capture_output=True,
                              text=True, timeout=60, cwd=REPO)

    import asyncio

    done = await asyncio.to_thread(cli, "pause")
    assert done.returncode == 0 and "actuation paused" in done.stdout, done.stderr
    assert load_pause(ctrl.store).paused
    done = await asyncio.to_thread(cli, "resume")
    assert done.returncode == 0 and "actuation resumed" in done.stdout, done.stderr
    assert not load_pause(ctrl.store).paused


async def test_with_a_token_the_token_is_the_check(tmp_path: Path) -> None:
    ctrl = Controller(settings=ControllerSettings(), policy_path=tmp_path / "policy.yaml", profiles_path=None,
                      store=StateStore(tmp_path / "s.db"))
    runner, url = await start_report_server(ctrl, "127.0.0.1:0", "s3cret")
    try:
        async with httpx.AsyncClient(timeout=5) as c:
            r = await c.post(url + "/api/pause", content=b"", headers={"Origin": "https://evil.example",
                                                                       "Content-Type": "text/plain"})
            assert r.status_code == 401  # no token: refused as before
            r = await c.post(url + "/api/pause", headers={"Authorization": "Bearer s3cret",
                                                          "Host": "controller.example:443"})
            assert r.status_code == 200 and r.json()["paused"] is True
    finally:
        await runner.cleanup()
        await ctrl.prom.aclose()
        ctrl.store.close()
