"""The hosts' recorded inventories in the state store (table ``host_inventory``): what each host's
GPUs were at its first report, or when the policy or an operator vouched for them
(planner/inventory.py decides; controller/hosts.py applies it). `fleetplan hosts confirm HOST`
writes here from another process; the controller notices through a generation counter in ``kv``
and reads the table again."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fleetplan.planner.inventory import Inventory, InventoryRecord, Voucher

if TYPE_CHECKING:
    from fleetplan.controller.state import StateStore

__all__ = ["GENERATION_KEY", "confirm", "generation", "inventory_of_status", "load_records", "save_records"]

GENERATION_KEY = "inventory_generation"  # bumped by every confirmation from outside the controller


def inventory_of_status(status: Mapping[str, Any]) -> Inventory | None:
    """The GPUs a host status (its JSON, as stored or received) reports; None: it reports none."""
    gpu, count = status.get("gpu"), status.get("gpu_count")
    if not isinstance(gpu, str) or not isinstance(count, int) or isinstance(count, bool):
        return None
    groups = tuple(tuple(int(i) for i in g) for g in status.get("nvlink_groups") or ())
    return Inventory(gpu, count, groups)


def load_records(db: sqlite3.Connection) -> dict[str, InventoryRecord]:
    out = {}
    for r in db.execute("SELECT host, gpu, gpu_count, nvlink_groups, since_s, voucher FROM host_inventory"):
        groups = tuple(tuple(int(i) for i in g) for g in json.loads(r[3]))
        out[str(r[0])] = InventoryRecord(Inventory(str(r[1]), int(r[2]), groups), float(r[4]), Voucher(r[5]))
    return out


def _upsert(c: sqlite3.Connection, host: str, rec: InventoryRecord) -> None:
    """Write `rec`; a first report never replaces a record (one judged before the store's records
    were read must not overwrite them)."""
    inv = rec.inventory
    first = rec.voucher == Voucher.FIRST_REPORT
    c.execute("INSERT INTO host_inventory(host, gpu, gpu_count, nvlink_groups, since_s, voucher) VALUES "
              "(?, ?, ?, ?, ?, ?) ON CONFLICT(host) DO " + ("NOTHING" if first else
              "UPDATE SET gpu=excluded.gpu, gpu_count=excluded.gpu_count, "
              "nvlink_groups=excluded.nvlink_groups, since_s=excluded.since_s, voucher=excluded.voucher"),
              (host, inv.gpu, inv.gpu_count, json.dumps([list(g) for g in inv.nvlink_groups]), rec.since_s,
               rec.voucher.value))


def save_records(store: StateStore, records: Mapping[str, InventoryRecord]) -> None:
    """The controller's new records (first reports, policy confirmations), one transaction."""
    if not records:
        return
    with store.tx() as c:
        for host, rec in sorted(records.items()):
            _upsert(c, host, rec)


def generation(store: StateStore) -> int:
    value = store.get_kv(GENERATION_KEY)
    return value if isinstance(value, int) else 0


def confirm(store: StateStore, host: str, now_s: float) -> tuple[InventoryRecord, InventoryRecord | None]:
    """An operator vouches for what `host` last reported (its status in the store): recorded, and
    the generation bumped so a running controller reads it. Returns (the new record, the one it
    replaces). LookupError (naming the host and the store) when the store has no status of it with
    GPUs."""
    statuses = store.host_statuses()
    if host not in statuses:
        known = ", ".join(sorted(statuses)) or "none"
        raise LookupError(f"{store.path}: no status of host {host!r} recorded (hosts: {known})")
    reported = inventory_of_status(statuses[host][0])
    if reported is None:
        raise LookupError(f"{store.path}: host {host!r}'s last status reports no GPUs: nothing to confirm")
    rec = InventoryRecord(reported, now_s, Voucher.OPERATOR)
    with store.tx() as c:
        before = load_records(c).get(host)
        _upsert(c, host, rec)
        row = c.execute("SELECT value FROM kv WHERE key=?", (GENERATION_KEY,)).fetchone()
        gen = json.loads(row[0]) if row is not None else 0
        store.set_kv(GENERATION_KEY, (gen if isinstance(gen, int) else 0) + 1, c)
    return rec, before
