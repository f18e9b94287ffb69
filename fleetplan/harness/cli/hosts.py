"""`fleetplan hosts`: the hosts' recorded inventories (what their GPUs are believed to be) and the
operator's confirmation of a change (controller/state_inventory.py; the rule: planner/inventory.py).

register() stays light: the store is imported in the handlers.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetplan.controller.state import StateStore

DEFAULT_DB = "/var/lib/fleetplan/state.db"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("hosts", help="the hosts' recorded GPU inventories; confirm a host's changed GPUs")
    hs = p.add_subparsers(dest="hosts_command", metavar="SUBCOMMAND")
    c = hs.add_parser("confirm", help="believe what HOST last reported (a changed GPU count or type, or a host "
                                      "the policy does not list); a running controller plans on it next cycle")
    c.add_argument("host")
    c.add_argument("--state-db", default=DEFAULT_DB, help="the controller's SQLite state file")
    c.set_defaults(handler=_confirm)
    ls = hs.add_parser("list", help="each host's recorded inventory beside its last report")
    ls.add_argument("--state-db", default=DEFAULT_DB, help="the controller's SQLite state file")
    ls.set_defaults(handler=_list)

    def usage(_: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(handler=usage)


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _open(path: str) -> StateStore:
    """The controller's store, read-write next to a running controller (WAL; short transactions)."""
    from pathlib import Path

    from fleetplan.controller.state import StateStore

    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: no such state database")
    return StateStore(path)


def _confirm(args: argparse.Namespace) -> int:
    from fleetplan.controller.state_inventory import confirm

    try:
        store = _open(args.state_db)
    except OSError as exc:
        print(f"fleetplan hosts confirm: {exc}", file=sys.stderr)
        return 2
    try:
        rec, before = confirm(store, args.host, time.time())
    except LookupError as exc:
        print(f"fleetplan hosts confirm: {exc.args[0]}", file=sys.stderr)
        return 1
    finally:
        store.close()
    was = f" (was {before.inventory.describe()}, from {before.voucher.value} at {_when(before.since_s)})" if before else ""
    groups = rec.inventory.groups()
    print(f"host {args.host}: {rec.inventory.describe()} in NVLink groups {[list(g) for g in groups]} confirmed{was}; "
          "the controller plans on it from its next cycle (the policy's entry for the host, if any, still bounds it)")
    return 0


def _list(args: argparse.Namespace) -> int:
    from fleetplan.controller.state_inventory import inventory_of_status, load_records

    try:
        store = _open(args.state_db)
    except OSError as exc:
        print(f"fleetplan hosts list: {exc}", file=sys.stderr)
        return 2
    try:
        records = load_records(store._db)
        statuses = store.host_statuses()
    finally:
        store.close()
    print(f"{'host':<16} {'recorded':<22} {'by':<13} {'since (UTC)':<20} last report")
    for host in sorted(set(records) | set(statuses)):
        rec = records.get(host)
        rep = inventory_of_status(statuses[host][0]) if host in statuses else None
        same = rec is not None and rep is not None and rep.same(rec.inventory)
        print(f"{host:<16} {rec.inventory.describe() if rec else '-':<22} {rec.voucher.value if rec else '-':<13} "
              f"{_when(rec.since_s) if rec else '-':<20} "
              f"{'(the same)' if same else rep.describe() + ' (differs)' if rep and rec else rep.describe() if rep else '-'}")
    return 0
