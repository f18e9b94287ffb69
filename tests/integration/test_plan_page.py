"""The plan page (GET /plan) opened in a real headless Chromium (Debian's `chromium`).

A real controller object (not started: no MQTT, no Prometheus) on a real state store holding 24 h
of cycles whose plans the real planner made (profiles from tests/e2e/data), behind the real report
server. Chromium takes a screenshot and dumps the DOM after its scripts ran; the test checks what a
person sees: a non-blank PNG with the capacity line's green in it, the chart's SVG paths drawn with
one point per stored cycle, and the plan's numbers on the page.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from fleetplan.controller.daemon import Controller, ControllerSettings
from fleetplan.controller.report import start_report_server
from fleetplan.controller.state import ActionStatus, StateStore
from fleetplan.harness.demo import demo_policy
from fleetplan.harness.rig_tools import PROFILES  # the lab's profiles (70B TP4, vLLM + TRT-LLM)
from fleetplan.planner.audit import decision_record, inputs_digest
from fleetplan.planner.core import plan, plan_to_dict
from fleetplan.planner.policy import load_policy_dict
from fleetplan.planner.types import Fleet, HostInventory, ModelObservation, Observation, PlannerState
from fleetplan.shared.benchfiles import load_profiles

pytestmark = pytest.mark.integration

MODEL = "llama-3.1-70b"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
HAVE_CHROMIUM = Path(CHROMIUM).exists()
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")
RATES = (0.4, 0.8, 1.6, 2.4, 3.2, 2.0, 1.2, 0.8)  # one cycle every 3 h over the last 24 h


async def chromium(tmp: Path, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, *FLAGS, f"--user-data-dir={tmp / 'chromium-profile'}", "--window-size=1200,2400",
        "--hide-scrollbars", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 90)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode(errors="replace")


@pytest.fixture
def filled_store(tmp_path: Path) -> tuple[Path, Path, list[dict[str, float]]]:
    doc = demo_policy(models=(MODEL,), hosts=[("h1", 8), ("h2", 8)], min_replicas=1, max_replicas=6,
                      ttft_p99_ms=800.0, itl_p99_ms=100.0, isl=1024, osl=256)
    doc["models"][0]["allowed"]["tp"] = [4]
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text(yaml.safe_dump(doc))
    policy = load_policy_dict(doc, str(policy_path))
    profiles = load_profiles(PROFILES)
    fleet = Fleet(tuple(HostInventory(h, policy.hosts[0].gpu, 8, (), True) for h in ("h1", "h2")), (), ())
    wall = [0.0]
    db = tmp_path / "state.db"
    store = StateStore(db, clock=lambda: wall[0])
    now = time.time()
    state = PlannerState.initial()
    points = []
    for i, rate in enumerate(RATES):
        t = now - 24 * 3600 + (i + 1) * 3 * 3600 - 60  # the last one a minute ago
        wall[0] = t
        result = plan(Observation({MODEL: ModelObservation(MODEL, rate, 1024.0, 256.0)}), fleet, policy,
                      profiles, state, t)
        state = result.next_state
        cid = store.begin_cycle(t)
        d = plan_to_dict(result)
        d.update(cycle_id=cid, now_s=t, observation={MODEL: {"rate_rps": rate, "stale": False}})
        store.save_plan(cid, d, 0.01)
        store.save_decision(decision_record(cycle_id=cid, now_s=t, digest=inputs_digest({"i": i}), plan_doc=d,
                                            issued=result.actions))
        for a in result.actions[:1]:
            store.add_action(None, cycle_id=cid, kind=a.kind.value, replica_id=f"r{cid:05d}", host=a.replica.host,
                             model=MODEL, status=ActionStatus.DONE, reason=a.reason)
        store.finish_cycle(cid, "ok", {})
        m = d["explanation"]["models"][0]
        points.append({"capacity": m["capacity_rps"], "required": m["required_rps"], "usd_h": d["plan"]["usd_h"],
                       "replicas": len(d["plan"]["replicas"])})
    store.close()
    return db, policy_path, points


def check_screenshot(shot: Path) -> None:
    """What a person sees: a real, non-blank image with the green capacity line drawn in it."""
    from matplotlib.image import imread

    img = imread(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert img.shape[0] >= 1000 and img.shape[1] >= 1000, img.shape
    rgb = (img[..., :3] * 255).round().astype(int) if img.dtype != np.uint8 else img[..., :3].astype(int)
    non_white = np.any(rgb < 235, axis=-1).mean()
    assert 0.01 < non_white < 0.9, f"blank-looking screenshot: {non_white:.3%} non-white pixels"
    green = np.all(np.abs(rgb - np.array([0x2C, 0xA0, 0x2C])) <= 24, axis=-1).sum()
    assert green > 200, f"the capacity line is not visible ({green} green pixels)"


async def test_plan_page_in_headless_chromium(tmp_path: Path, filled_store) -> None:  # type: ignore[no-untyped-def]
    if not HAVE_CHROMIUM:
        pytest.fail("chromium is not installed: scripts/setup.sh installs Debian's chromium")
    db, policy_path, points = filled_store
    ctrl = Controller(settings=ControllerSettings(), policy_path=policy_path, profiles_path=None,
                      store=StateStore(db))
    ctrl.load_policy(initial=True)
    runner, url = await start_report_server(ctrl, "127.0.0.1:0", None)
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.get(url + "/plan")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in r.headers["content-security-policy"]
        # self-contained: nothing fetched from anywhere (no src/href to a URL, no @import)
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", r.text) and "@import" not in r.text

        shot = tmp_path / "plan.png"
        await chromium(tmp_path, f"--screenshot={shot}", url + "/plan")
        dom = await chromium(tmp_path, "--dump-dom", url + "/plan")
    finally:
        await runner.cleanup()
        await ctrl.prom.aclose()
        ctrl.store.close()

    check_screenshot(shot)

    # the chart drawn in the DOM: one path per series, one point per stored cycle
    paths = re.findall(r'<path class="series" data-series="([a-z_]+)" data-points="(\d+)" d="([^"]+)"', dom)
    got = {s: (int(n), d) for s, n, d in paths}
    assert set(got) >= {"observed_rps", "forecast_rps", "capacity_rps", "required_rps"}, got.keys()
    n, d = got["capacity_rps"]
    assert n == len(RATES) and d.startswith("M") and d.count("L") == len(RATES) - 1
    ys = [float(p.split(",")[1]) for p in re.findall(r"[ML]([\d.]+,[\d.]+)", got["observed_rps"][1])]
    assert ys[4] < ys[0], "the peak demand is drawn higher than the first point (SVG y grows down)"
    # the numbers: the current plan's capacity, required rate, replicas and $/h
    last = points[-1]
    assert f"{last['capacity']:.2f}" in dom and f"{last['required']:.2f}" in dom
    assert f"<b>{last['replicas']}</b> replicas" in dom and f"${last['usd_h']:.2f}/h" in dom
    assert 'id="actions"' in dom and f"{len(RATES)}-" in dom  # the actions timeline names the decisions
    assert "SLO attainment predicted" in dom  # what the plan expects of each config (issue 18)
