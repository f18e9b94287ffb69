"""`fleetplan lab up | down | status`: the lab (fleetplan.harness.lab) in the background, described by
DIR/lab.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fleetplan.harness.lab import LAB_JSON, Lab
from fleetplan.harness.procs import LabError, group_pids
from fleetplan.models.names import parse_gpu


def register(subparsers: Any) -> None:
    lab = subparsers.add_parser(
        "lab", help="start/stop the lab: Mosquitto, Prometheus, nginx, the pool proxy, simulated hosts"
    )
    lab_sub = lab.add_subparsers(dest="lab_command", metavar="ACTION", required=True)
    up = lab_sub.add_parser("up", help="start the lab in the background; writes DIR/lab.json")
    up.add_argument(
        "--dir", required=True, type=Path, help="lab directory (created; configs, logs, lab.json)"
    )
    up.add_argument("--hosts", type=int, default=4, help="simulated GPU hosts (default 4)")
    up.add_argument("--gpus-per-host", type=int, default=8, help="GPUs per host (default 8)")
    up.add_argument("--gpu", default="h100", help="GPU type of the hosts (default h100)")
    up.set_defaults(handler=_cmd_up)
    down = lab_sub.add_parser("down", help="stop a lab started with `lab up`")
    down.add_argument("--dir", required=True, type=Path)
    down.set_defaults(handler=_cmd_down)
    status = lab_sub.add_parser("status", help="print lab.json and whether each server runs")
    status.add_argument("--dir", required=True, type=Path)
    status.set_defaults(handler=_cmd_status)


def _cmd_up(args: argparse.Namespace) -> int:
    if (args.dir / LAB_JSON).exists():
        try:
            existing = Lab.attach(args.dir)
        except LabError:
            existing = None
        if existing is not None and existing.process_groups():
            print(
                f"error: a lab is already running in {args.dir} (fleetplan lab down --dir {args.dir})",
                file=sys.stderr,
            )
            return 1
    if args.hosts < 0 or args.gpus_per_host < 1:
        print("error: --hosts must be >= 0 and --gpus-per-host >= 1", file=sys.stderr)
        return 2
    try:
        gpu = parse_gpu(args.gpu)
    except ValueError as exc:
        print(f"error: --gpu: {exc}", file=sys.stderr)
        return 2
    lab = Lab(args.dir, hosts=args.hosts, gpus_per_host=args.gpus_per_host, gpu=gpu)
    try:
        lab.start()
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {k: v for k, v in lab.to_json().items() if k != "hosts"} | {"hosts": [h.name for h in lab.hosts]},
            indent=2,
        )
    )
    print(f"lab up: {lab.dir / LAB_JSON}; stop with: fleetplan lab down --dir {args.dir}", file=sys.stderr)
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    try:
        lab = Lab.attach(args.dir)
        lab.stop()
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"lab down: {args.dir}", file=sys.stderr)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    try:
        lab = Lab.attach(args.dir)
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    doc = lab.to_json()
    doc["running"] = {name: bool(group_pids(pgid)) for name, pgid in lab.process_groups().items()}
    print(json.dumps(doc, indent=2))
    return 0 if lab.process_groups() else 1
