"""POST /api/pause and /api/resume on the real report server: the bearer token, the body check, and
the pause persisted in the real state store (a new controller on the same database is paused)."""

from __future__ import annotations

from pathlib import Path

import httpx

from fleetplan.controller.actuation import load_pause
from fleetplan.controller.daemon import Controller, ControllerSettings
from fleetplan.controller.report import start_report_server
from fleetplan.controller.state import StateStore


async def test_pause_resume_need_the_token_and_persist(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    ctrl = Controller(settings=ControllerSettings(), policy_path=tmp_path / "policy.yaml", profiles_path=None,
                      store=StateStore(db))
    runner, url = await start_report_server(ctrl, "0.0.0.0:0", "s3cret")
    base = url.replace("0.0.0.0", "127.0.0.1")
    auth = {"Authorization": "Bearer s3cret"}
    try:
        async with httpx.AsyncClient(timeout=5) as c:
            assert (await c.post(base + "/api/pause", json={})).status_code == 401
            assert (await c.post(base + "/api/pause", json={}, headers={"Authorization": "Bearer x"})).status_code == 401
            assert not load_pause(ctrl.store).paused
            bad = await c.post(base + "/api/pause", json={"reason": 5}, headers=auth)
            assert bad.status_code == 400 and "body.reason" in bad.text
            r = await c.post(base + "/api/pause", json={"reason": "disk on h3"}, headers=auth)
            assert r.status_code == 200 and r.json()["paused"] is True and r.json()["reason"] == "disk on h3"
            # persisted: a controller restarted on the same database starts paused
            again = StateStore(db)
            assert load_pause(again).paused and load_pause(again).reason == "disk on h3"
            again.close()
            r = await c.post(base + "/api/resume", headers=auth)
            assert r.status_code == 200 and r.json()["paused"] is False
            assert not load_pause(ctrl.store).paused
    finally:
        await runner.cleanup()
        await ctrl.prom.aclose()
        ctrl.store.close()


async def test_a_tokenless_loopback_api_refuses_requests_through_a_proxy(tmp_path: Path) -> None:
    """Loopback without a token is for this machine; a reverse proxy in front (it adds forwarding
    headers) would hand it to the network: refused until the controller has a token."""
    ctrl = Controller(settings=ControllerSettings(), policy_path=tmp_path / "policy.yaml", profiles_path=None,
                      store=StateStore(tmp_path / "state.db"))
    runner, url = await start_report_server(ctrl, "127.0.0.1:0", None)
    try:
        async with httpx.AsyncClient(timeout=5) as c:
            assert (await c.post(url + "/api/pause", json={})).status_code == 200  # this machine
            for header in ({"X-Forwarded-For": "203.0.113.7"}, {"Forwarded": "for=203.0.113.7"}):
                r = await c.post(url + "/api/resume", headers=header)
                assert r.status_code == 403 and "bearer token" in r.json()["error"]
            assert load_pause(ctrl.store).paused  # the proxied resume did nothing
            assert (await c.get(url + "/healthz", headers={"X-Forwarded-For": "203.0.113.7"})).status_code != 403
    finally:
        await runner.cleanup()
        await ctrl.prom.aclose()
        ctrl.store.close()
