"""The state store's logs: cycles, observations and plans, the decision records (the audit trail),
the action log and the alerts: what the report API and the brakes read."""


import json
import sqlite3
from collections.abc import Iterable, Mapping
from typing import Any

from fleetplan.controller.state_base import StoreBase

# the records' types are the act core's (planner/act.py decides on them; this module persists them)
from fleetplan.planner.records import LogEntry


class StoreLogs(StoreBase):
    """Cycles, plans, decisions, actions and alerts (a base of `StateStore`)."""

    # -- cycles -----------------------------------------------------------------------------
    def begin_cycle(self, now_s: float) -> int:
        with self.tx() as c:
            cur = c.execute(
                "INSERT INTO cycles(started_s, now_s, status) VALUES (?, ?, 'running')", (self._clock(), now_s)
            )
            return int(cur.lastrowid or 0)

    def finish_cycle(self, cycle_id: int, status: str, summary: Mapping[str, Any]) -> None:
        with self.tx() as c:
            c.execute(
                "UPDATE cycles SET finished_s=?, status=?, summary=? WHERE cycle_id=?",
                (self._clock(), status, json.dumps(summary), cycle_id),
            )

    def cycles(self, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT * FROM cycles ORDER BY cycle_id DESC LIMIT ?", (limit,)).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d["summary"] = json.loads(d["summary"]) if d["summary"] else None
            out.append(d)
        return out

    def save_observation(self, cycle_id: int, payload: Mapping[str, Any]) -> None:
        with self.tx() as c:
            c.execute(
                "INSERT OR REPLACE INTO observations(cycle_id, created_s, payload) VALUES (?, ?, ?)",
                (cycle_id, self._clock(), json.dumps(payload)),
            )

    def save_plan(
        self, cycle_id: int, payload: Mapping[str, Any], solve_s: float | None, planner_state: Any = None
    ) -> None:
        """The plan dict (rendered by reports, never recomputed) and the planner state, atomically."""
        with self.tx() as c:
            c.execute(
                "INSERT OR REPLACE INTO plans(cycle_id, created_s, solve_s, payload) VALUES (?, ?, ?, ?)",
                (cycle_id, self._clock(), solve_s, json.dumps(payload, default=str)),
            )
            if planner_state is not None:
                self.set_kv("planner_state", planner_state, c)

    def last_plan(self) -> tuple[int, dict[str, Any], float | None] | None:
        row = self._db.execute("SELECT * FROM plans ORDER BY cycle_id DESC LIMIT 1").fetchone()
        if row is None:
            return None
        return int(row["cycle_id"]), json.loads(row["payload"]), row["solve_s"]

    # -- decisions (the audit trail) ------------------------------------------------------------
    def save_decision(self, record: Mapping[str, Any]) -> None:
        with self.tx() as c:
            c.execute(
                "INSERT OR REPLACE INTO decisions(cycle_id, decision_id, created_s, now_s, payload) "
                "VALUES (?, ?, ?, ?, ?)",
                (int(record["cycle_id"]), str(record["decision_id"]), self._clock(), float(record["now_s"]),
                 json.dumps(record, default=str)),
            )

    def decisions(self, since_s: float | None = None, limit: int = 5000) -> list[dict[str, Any]]:
        """Decision records created at or after `since_s` (wall seconds), oldest first."""
        rows = self._db.execute(
            "SELECT created_s, payload FROM decisions WHERE created_s >= ? ORDER BY cycle_id DESC LIMIT ?",
            (since_s if since_s is not None else float("-inf"), limit),
        ).fetchall()
        return [{**json.loads(r["payload"]), "created_s": float(r["created_s"])} for r in reversed(rows)]

    def last_observation(self) -> dict[str, Any] | None:
        row = self._db.execute("SELECT payload FROM observations ORDER BY cycle_id DESC LIMIT 1").fetchone()
        return None if row is None else dict(json.loads(row["payload"]))

    # -- actions ---------------------------------------------------------------------------------
    def add_action(
        self,
        conn: sqlite3.Connection | None,
        *,
        cycle_id: int | None,
        kind: str,
        replica_id: str | None,
        host: str | None,
        model: str | None,
        status: str,
        reason: str = "",
        detail: str = "",
    ) -> int:
        now = self._clock()
        sql = (
            "INSERT INTO actions(cycle_id, created_s, updated_s, kind, replica_id, host, model, status, reason, "
            "detail) VALUES (?,?,?,?,?,?,?,?,?,?)"
        )
        args = (cycle_id, now, now, kind, replica_id, host, model, status, reason, detail)
        if conn is not None:
            return int(conn.execute(sql, args).lastrowid or 0)
        with self.tx() as c:
            return int(c.execute(sql, args).lastrowid or 0)

    def update_action(
        self, action_id: int, status: str, detail: str | None = None, conn: sqlite3.Connection | None = None
    ) -> None:
        sql = "UPDATE actions SET status=?, updated_s=?, detail=COALESCE(?, detail) WHERE action_id=?"
        args = (status, self._clock(), detail, action_id)
        if conn is not None:
            conn.execute(sql, args)
            return
        with self.tx() as c:
            c.execute(sql, args)

    def update_actions_for(self, replica_id: str, kind: str, from_status: Iterable[str], status: str,
                           detail: str | None = None) -> None:
        st = list(from_status)
        q = ",".join("?" * len(st))
        with self.tx() as c:
            c.execute(
                f"UPDATE actions SET status=?, updated_s=?, detail=COALESCE(?, detail) "
                f"WHERE replica_id=? AND kind=? AND status IN ({q})",
                (status, self._clock(), detail, replica_id, kind, *st),
            )

    def actions(self, limit: int = 50, statuses: Iterable[str] | None = None) -> list[dict[str, Any]]:
        # each action carries the id of the decision (cycle) that issued it
        sel = "SELECT a.*, d.decision_id FROM actions a LEFT JOIN decisions d ON d.cycle_id = a.cycle_id"
        if statuses is None:
            rows = self._db.execute(f"{sel} ORDER BY a.action_id DESC LIMIT ?", (limit,)).fetchall()
        else:
            st = list(statuses)
            q = ",".join("?" * len(st))
            rows = self._db.execute(
                f"{sel} WHERE a.status IN ({q}) ORDER BY a.action_id DESC LIMIT ?", (*st, limit)
            ).fetchall()
        return [dict(r) for r in rows]

    def action_entries(self, since_s: float) -> list[LogEntry]:
        """The action log since `since_s` as the brakes read it (planner/records.py `history`), with
        the GPUs of the replica each entry names."""
        rows = self._db.execute(
            "SELECT a.kind, a.status, a.cycle_id IS NOT NULL AS by_cycle, a.created_s, a.replica_id, "
            "r.tp AS gpus FROM actions a LEFT JOIN replicas r ON r.replica_id = a.replica_id "
            "WHERE a.created_s >= ? ORDER BY a.action_id", (since_s,)).fetchall()
        return [LogEntry(str(r["kind"]), str(r["status"]), bool(r["by_cycle"]), float(r["created_s"]),
                         r["replica_id"], None if r["gpus"] is None else int(r["gpus"])) for r in rows]

    def actions_since(self, since_s: float, limit: int = 5000) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT a.*, d.decision_id FROM actions a LEFT JOIN decisions d ON d.cycle_id = a.cycle_id "
            "WHERE a.created_s >= ? ORDER BY a.action_id LIMIT ?", (since_s, limit)
        ).fetchall()
        return [dict(r) for r in rows]

    def action_counts(self) -> dict[str, int]:
        rows = self._db.execute("SELECT kind, status, COUNT(*) AS n FROM actions GROUP BY kind, status").fetchall()
        return {f"{r['kind']}/{r['status']}": int(r["n"]) for r in rows}

    # -- alerts ----------------------------------------------------------------------------------
    def set_alerts(self, key_prefix: str, alerts: Mapping[str, str]) -> None:
        """Make exactly `alerts` (key -> text) active among keys starting with `key_prefix`."""
        now = self._clock()
        with self.tx() as c:
            active = {
                r["key"]: (r["alert_id"], r["text"])
                for r in c.execute(
                    "SELECT alert_id, key, text FROM alerts WHERE active=1 AND key LIKE ?", (key_prefix + "%",)
                ).fetchall()
            }
            for key, (aid, text) in active.items():
                if alerts.get(key) != text:
                    c.execute("UPDATE alerts SET active=0, cleared_s=? WHERE alert_id=?", (now, aid))
            for key, text in alerts.items():
                if key not in active or active[key][1] != text:
                    c.execute("INSERT INTO alerts(created_s, key, text) VALUES (?, ?, ?)", (now, key, text))

    def active_alerts(self) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT * FROM alerts WHERE active=1 ORDER BY alert_id").fetchall()
        return [dict(r) for r in rows]

    def recent_alerts(self, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT * FROM alerts ORDER BY alert_id DESC LIMIT ?", (limit,)).fetchall()
        return [dict(r) for r in rows]
