"""`fleetplan history` on a real state database (no servers): --since, --model, the timeline text."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetplan.controller.state import ActionStatus, StateStore
from fleetplan.harness.cli import main
from fleetplan.harness.cli.ops import parse_duration_s
from fleetplan.planner.audit import decision_record
from tests.unit.planner.test_audit import plan_doc


def fill(db: Path, now: float) -> None:
    wall = [now]
    s = StateStore(db, clock=lambda: wall[0])
    held = [{"kind": "drain", "replica_id": "r00002", "model": "m", "host": "h2",
             "limit": "max_gpus_stopped_per_hour", "detail": "4 GPU(s) stopped in the last hour + 4 > 4"}]
    for i, (age_s, reps, h) in enumerate([(5 * 3600, {"m": 9, "n": 1}, []), (3000, {"m": 1, "n": 1}, []),
                                           (1800, {"m": 2, "n": 1}, []), (600, {"m": 2, "n": 2}, held)], 1):
        wall[0] = now - age_s
        cid = s.begin_cycle(wall[0])
        assert cid == i
        s.save_decision(decision_record(cycle_id=cid, now_s=wall[0], digest=f"{cid:064x}",
                                        plan_doc=plan_doc(reps, h), issued=()))
        if cid == 3:
            s.add_action(None, cycle_id=cid, kind="start", replica_id="r00003", host="h1", model="m",
                         status=ActionStatus.DONE, reason="start m/vllm/h100x4/bf16 on h1")
    wall[0] = now - 300
    s.add_action(None, cycle_id=None, kind="adopt", replica_id="r00077", host="h2", model="n",
                 status=ActionStatus.DONE, reason="running engine unknown to the controller: adopted")
    s.close()


def test_history_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import time

    db = tmp_path / "state.db"
    fill(db, time.time())
    assert main(["history", "--state-db", str(db), "--since", "2h"]) == 0
    out = capsys.readouterr().out
    assert "decision 1-" not in out  # 5 h old
    lines = out.splitlines()
    assert lines[0].endswith("decision 2-00000000") and "m: replicas ? -> 1" in lines[1]
    assert "m: replicas 1 -> 2" in out and "start  r00003" in out and "done" in out
    assert "held   r00002" in out and "held back by max_gpus_stopped_per_hour: 4 GPU(s)" in out
    assert "adopt r00077 on h2 done (no decision: running engine unknown" in out
    assert out.index("decision 4-") < out.index("adopt r00077")  # time order
    assert "why: inventory h100: 16/16 GPUs" in out

    assert main(["history", "--state-db", str(db), "--since", "2h", "--model", "n"]) == 0
    out_n = capsys.readouterr().out
    assert "r00003" not in out_n and "n: replicas 1 -> 2" in out_n and "m:" not in out_n
    assert "held" not in out_n and "adopt r00077" in out_n


def test_history_errors_name_the_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["history", "--state-db", str(tmp_path / "nope.db")]) == 2
    assert "nope.db: no such state database" in capsys.readouterr().err
    (tmp_path / "x.db").write_text("not sqlite")
    assert main(["history", "--state-db", str(tmp_path / "x.db")]) == 2
    assert "x.db: cannot read" in capsys.readouterr().err
    assert main(["history", "--state-db", str(tmp_path / "x.db"), "--since", "2 weeks"]) == 2
    assert "--since '2 weeks'" in capsys.readouterr().err
    assert parse_duration_s("90s") == 90 and parse_duration_s("2h") == 7200 and parse_duration_s("1.5d") == 129600
