"""Many on-call readers of the report API do not stop the loop: the real report server of a real
controller (real Mosquitto and Prometheus, the controller's own cycles) under 200 concurrent
readers of /api/report, /plan, /api/explain, /api/state and /metrics. The report is gathered once
per cycle whatever the number of requests, the answers are paced at `report_max_rps`, every
answer shows the last finished cycle, and beyond `report_max_concurrent` reads in flight the
answer is 503 with Retry-After while /healthz and pause keep answering. (The cycle period under readers, quiet vs loaded, at 1,000 simulated hosts:
bench/report_readers.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from fleetplan.controller.daemon import Controller, ControllerSettings
from fleetplan.controller.mqtt import MqttSettings
from fleetplan.controller.report import start_report_server
from fleetplan.controller.report_gate import READ_BURST
from fleetplan.controller.report_snapshot import Gathered, Rendered, ReportSnapshot, render
from fleetplan.controller.state import StateStore
from fleetplan.harness.servers import MosquittoServer, PrometheusServer

REPO = Path(__file__).resolve().parents[2]
READERS = 200
CYCLES = 4


@pytest.fixture
async def ctrl(mosquitto: MosquittoServer, prometheus: PrometheusServer, tmp_path: Path) -> AsyncIterator[Controller]:
    policy = tmp_path / "policy.yaml"
    policy.write_text((REPO / "config" / "example-policy.yaml").read_text())
    settings = ControllerSettings(
        prometheus_url=prometheus.url, history_s=600.0,
        mqtt=MqttSettings(host=mosquitto.host, port=mosquitto.port, username=mosquitto.controller_user,
                          password=mosquitto.controller_password, keepalive_s=5, backoff_initial_s=0.1,
                          backoff_max_s=0.5))
    c = Controller(settings=settings, policy_path=policy, profiles_path=None, store=StateStore(tmp_path / "state.db"),
                   report_listen="127.0.0.1:0")
    await c.start()
    await asyncio.wait_for(c.link.connected.wait(), 10)
    try:
        yield c
    finally:
        with contextlib.suppress(Exception):
            await c.stop()


def last_cycle(ctrl: Controller) -> int:
    last = ctrl.store.last_plan()
    assert last is not None, "no plan stored"
    return last[0]


async def test_200_readers_get_one_gather_per_cycle_and_the_last_cycle(ctrl: Controller) -> None:
    assert (await ctrl.cycle()).get("error") is None
    url = ctrl.report_url
    assert url is not None
    model = ctrl.model_names()[0]
    paths = ("/api/report", "/plan", f"/api/explain/{model}", "/api/state", "/metrics")
    finished = [last_cycle(ctrl)]  # the last cycle whose plan is stored, as the readers send
    stop, all_answered = asyncio.Event(), asyncio.Event()
    answers: Counter[tuple[str, int]] = Counter()
    stale: list[tuple[int, int]] = []  # (finished when sent, cycle served)
    per_reader = [0] * READERS

    async def reader(i: int, http: httpx.AsyncClient) -> None:
        k = i
        while not stop.is_set():
            path = paths[k % len(paths)]
            k += 1
            sent = finished[0]
            r = await http.get(url + path)
            answers[(path.split("/")[-1] if "explain" not in path else "explain", r.status_code)] += 1
            if r.status_code == 503:
                assert r.headers["Retry-After"] == "1" and "report_max_concurrent" in r.json()["error"]
                await asyncio.sleep(0.05)
                continue
            assert r.status_code == 200, (path, r.text[:300])
            per_reader[i] += 1
            if per_reader[i] == 1 and min(per_reader) > 0:
                all_answered.set()
            if path == "/api/report" and r.json()["cycle_id"] < sent:
                stale.append((sent, r.json()["cycle_id"]))

    gathers0 = ctrl.reports.gathers
    t0 = asyncio.get_running_loop().time()
    limits = httpx.Limits(max_connections=READERS, max_keepalive_connections=READERS)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        tasks = [asyncio.create_task(reader(i, http)) for i in range(READERS)]
        try:
            for _ in range(CYCLES):
                summary = await ctrl.cycle()
                assert summary.get("error") is None, summary
                finished[0] = last_cycle(ctrl)
                await asyncio.sleep(0.2)  # the readers read this cycle's snapshot a while
            await asyncio.wait_for(all_answered.wait(), 120)  # every reader answered at least once
        finally:
            stop.set()
            await asyncio.gather(*tasks)
    elapsed_s = asyncio.get_running_loop().time() - t0

    served = sum(n for (_, status), n in answers.items() if status == 200)
    # one gather per cycle, not per request: hundreds of answers, CYCLES gathers
    assert ctrl.reports.gathers == gathers0 + CYCLES, (ctrl.reports.gathers, gathers0)
    assert served > 10 * CYCLES and min(per_reader) >= 1, answers
    # paced: never more answers than report_max_rps allows over the run (plus the burst)
    assert served <= ctrl.settings.report_max_rps * elapsed_s + READ_BURST + 1, (served, elapsed_s)
    assert ctrl.reports.renders <= ctrl.reports.gathers
    # /api/state: gathered at most once per snapshot, however many asked
    assert 1 <= ctrl.reports.state_gathers <= CYCLES + 1 < answers[("state", 200)], (ctrl.reports.state_gathers, answers)
    # every /api/report answer shows the last cycle finished when it was sent, or a later one
    assert not stale, stale[:5]
    # /metrics: scrapes share renders (at most one per METRICS_MAX_AGE_S), far fewer than scrapes
    scrapes = answers[("metrics", 200)]
    assert ctrl.reports.exposition is not None and ctrl.reports.exposition.renders < scrapes / 2, (
        ctrl.reports.exposition.renders if ctrl.reports.exposition else None, scrapes)
    # the stored decisions: one per cycle, readers or not
    assert len(ctrl.store.decisions()) == CYCLES + 1


async def test_beyond_the_bound_reads_get_503_while_healthz_and_pause_answer(tmp_path: Path) -> None:
    """Reads in flight (here: waiting for a render that is held) up to report_max_concurrent; the
    next one is refused at once with 503 + Retry-After; /healthz and pause are never refused."""
    limit = 4
    release = threading.Event()

    def held_render(g: Gathered) -> Rendered:
        assert release.wait(30), "the render was never released"
        return render(g)

    ctrl = Controller(settings=ControllerSettings(report_max_concurrent=limit), policy_path=tmp_path / "policy.yaml",
                      profiles_path=None, store=StateStore(tmp_path / "s.db"))
    ctrl.reports = ReportSnapshot(held_render)
    runner, url = await start_report_server(ctrl, "127.0.0.1:0", None)
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            waiting = [asyncio.create_task(http.get(url + "/api/report")) for _ in range(limit)]
            while ctrl.reports.waiting < limit:
                assert not any(t.done() for t in waiting), [t.result().text for t in waiting if t.done()]
                await asyncio.sleep(0.01)
            for path in ("/api/report", "/plan", "/metrics", "/api/state"):
                busy = await http.get(url + path)
                assert busy.status_code == 503 and busy.headers["Retry-After"] == "1", (path, busy.text)
                assert f"the limit is {limit}" in busy.json()["error"] and "report_max_concurrent" in busy.json()["error"]
            health = await http.get(url + "/healthz")  # answered (this controller was never started: 503)
            assert "problems" in health.json() and "MQTT task not started" in health.json()["problems"], health.text
            paused = await http.post(url + "/api/pause", json={"reason": "incident"})
            assert paused.status_code == 200 and paused.json()["paused"] is True, paused.text
            release.set()
            done = await asyncio.gather(*waiting)
            assert [r.status_code for r in done] == [200] * limit
            # the pause's refresh: the next read shows it
            report = (await http.get(url + "/api/report")).json()
            assert report["actuation"]["paused"] is True and report["actuation"]["reason"] == "incident"
            metrics = (await http.get(url + "/metrics")).text
            assert "fleetplan_report_refused_total 4.0" in metrics
    finally:
        release.set()
        await runner.cleanup()
        await ctrl.prom.aclose()
        ctrl.store.close()
