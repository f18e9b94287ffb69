"""The state store's desired states: per host the version and payload committed before a publish,
the acks, the version floors and the hosts' last statuses."""


import json
import logging
import sqlite3
from collections.abc import Iterable, Mapping
from typing import Any

from fleetplan.controller.state_base import MAX_VERSION, build_row, replica_row
from fleetplan.controller.state_log import StoreLogs

# the records' types are the act core's (planner/act.py decides on them; this module persists them)
from fleetplan.planner.act import (
    DesiredRow,
    Phase,
)

log = logging.getLogger(__name__)


class StoreDesired(StoreLogs):
    """Desired states, acks and host statuses (a base of `StateStore`)."""

    # -- desired state per host ---------------------------------------------------------------
    def desired_rows(self) -> dict[str, DesiredRow]:
        out = {}
        for r in self._db.execute("SELECT * FROM desired").fetchall():
            out[r["host"]] = DesiredRow(
                host=r["host"], version=int(r["version"]), payload=json.loads(r["payload"]),
                published_s=r["published_s"], acked_version=r["acked_version"],
                ack_accepted=None if r["ack_accepted"] is None else bool(r["ack_accepted"]),
                ack_errors=tuple(json.loads(r["ack_errors"] or "[]")),
            )
        return out

    def desired_payload(self, host: str, conn: sqlite3.Connection | None = None) -> dict[str, Any]:
        """The full desired state of `host` derived from the replicas table (phase desired/draining)."""
        db = conn or self._db
        rows = db.execute(
            "SELECT * FROM replicas WHERE host=? AND phase IN (?, ?) ORDER BY replica_id",
            (host, Phase.DESIRED, Phase.DRAINING),
        ).fetchall()
        builds = db.execute(
            "SELECT * FROM builds WHERE host=? AND phase=? ORDER BY build_id", (host, Phase.DESIRED)
        ).fetchall()
        return {
            "replicas": [replica_row(r).desired_entry() for r in rows],
            "builds": [build_row(b).desired_entry() for b in builds],
        }

    def stage_desired(self, conn: sqlite3.Connection, host: str) -> dict[str, Any]:
        """Bump the host's desired version and store the payload to publish (inside `conn`'s tx)."""
        row = conn.execute("SELECT version FROM desired WHERE host=?", (host,)).fetchone()
        version = (int(row["version"]) + 1) if row else 1
        # never go below what an agent may already have applied from an earlier database
        floor = conn.execute("SELECT value FROM kv WHERE key=?", (f"version_floor/{host}",)).fetchone()
        floor_v = json.loads(floor["value"]) if floor is not None else None
        if isinstance(floor_v, int) and 0 <= floor_v < MAX_VERSION:  # an absurd floor (old database) is ignored
            version = max(version, floor_v + 1)
        payload = {"version": version, **self.desired_payload(host, conn)}
        conn.execute(
            "INSERT INTO desired(host, version, payload, published_s) VALUES (?, ?, ?, NULL) "
            "ON CONFLICT(host) DO UPDATE SET version=excluded.version, payload=excluded.payload, "
            "published_s=NULL",
            (host, version, json.dumps(payload)),
        )
        return payload

    def note_version_floor(self, host: str, applied_version: int | None) -> None:
        """Agents report the version they applied; our next version must be above it."""
        self.note_version_floors({host: applied_version})

    def note_version_floors(self, applied: Mapping[str, int | None]) -> None:
        """note_version_floor for many hosts in one transaction (one commit per cycle, not per host)."""
        ok = {h: v for h, v in applied.items() if v is not None and 0 <= v < MAX_VERSION}
        if not ok:
            return  # never a floor no later version can pass (the protocol already bounds it)
        with self.tx() as c:
            for host, version in ok.items():
                cur = self.get_kv(f"version_floor/{host}")
                if not isinstance(cur, int) or not 0 <= cur < MAX_VERSION or cur < version:
                    self.set_kv(f"version_floor/{host}", version, c)

    def mark_published(self, published: Mapping[str, int]) -> None:
        """host -> the desired version just published (one transaction)."""
        if not published:
            return
        now = self._clock()
        with self.tx() as c:
            c.executemany("UPDATE desired SET published_s=? WHERE host=? AND version=?",
                          [(now, host, version) for host, version in published.items()])

    def record_ack(self, host: str, version: int | None, accepted: bool, errors: Iterable[str]) -> None:
        errs = list(errors)
        with self.tx() as c:
            c.execute(
                "INSERT INTO acks(host, version, accepted, errors, received_s) VALUES (?, ?, ?, ?, ?)",
                (host, version, int(accepted), json.dumps(errs), self._clock()),
            )
            c.execute(
                "UPDATE desired SET acked_version=?, ack_accepted=?, ack_errors=? WHERE host=? AND version=?",
                (version, int(accepted), json.dumps(errs), host, version),
            )

    def acks(self, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT * FROM acks ORDER BY ack_id DESC LIMIT ?", (limit,)).fetchall()
        return [{**dict(r), "errors": json.loads(r["errors"])} for r in rows]

    # -- host status ----------------------------------------------------------------------------
    def planner_state(self) -> Any:
        """The planner's state the last cycle saved (planner.types.PlannerState); unreadable or
        absent: a fresh one (logged)."""
        from fleetplan.planner.policy import PolicyError
        from fleetplan.planner.serde import state_from_dict
        from fleetplan.planner.types import PlannerState

        d = self.get_kv("planner_state")
        if not d:
            return PlannerState.initial()
        try:
            return state_from_dict(d, "state store: planner_state")
        except PolicyError as exc:
            log.warning("stored planner state unreadable (%s); starting fresh", exc)
            return PlannerState.initial()

    def save_host_statuses(self, payloads: Mapping[str, Mapping[str, Any]]) -> None:
        """The hosts' last statuses (one transaction for a batch)."""
        if not payloads:
            return
        now = self._clock()
        with self.tx() as c:
            c.executemany(
                "INSERT INTO host_status(host, payload, received_s) VALUES (?, ?, ?) ON CONFLICT(host) DO "
                "UPDATE SET payload=excluded.payload, received_s=excluded.received_s",
                [(host, json.dumps(p, default=str), now) for host, p in payloads.items()],
            )

    def host_statuses(self) -> dict[str, tuple[dict[str, Any], float]]:
        return {
            r["host"]: (json.loads(r["payload"]), float(r["received_s"]))
            for r in self._db.execute("SELECT * FROM host_status").fetchall()
        }
