"""`fleetplan models capacity ... --disagg`: one prefill and one decode replica's capacity, and with
`--rate` the cheaper of the aggregated fleet and the disaggregated pools (models/disagg.py,
planner/disagg_choice.py)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

# --link: the path between a prefill and a decode replica (host: the GPU's NVLink, or PCIe)
LINKS = ("host", "ib400", "eth100", "eth25")


def disagg_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--disagg", action="store_true",
                   help="also size a prefill replica (TTFT target) and a decode replica (ITL target)")
    p.add_argument("--link", choices=LINKS, default="host",
                   help="KV path between the pools: host (NVLink, or PCIe without it), ib400 (400 Gb/s "
                        "InfiniBand per GPU), eth100, eth25 (Ethernet); default host")
    p.add_argument("--rate", type=float, metavar="RPS",
                   help="with --disagg: the demand; prints both fleets and which is cheaper")
    p.add_argument("--headroom", type=float, default=0.0, metavar="H", help="size for rate x (1 + H)")
    p.add_argument("--price-usd-h", type=float, metavar="P", help="$ per GPU-hour (default: a list price)")


def _link(name: str, gpu: Any) -> Any:
    from fleetplan.models import disagg

    if name == "host":
        return disagg.host_link(gpu)
    return {"ib400": disagg.IB_NDR_400G, "eth100": disagg.ETH_100G, "eth25": disagg.ETH_25G}[name]


def _cap_doc(c: Any) -> dict[str, Any]:
    return {"max_rps": c.max_rps if math.isfinite(c.max_rps) else None, "binding": c.binding,
            "floor_share": c.floor_share}


def _pool_doc(p: Any) -> dict[str, Any]:
    return {"replicas": p.replicas, "gpus": p.gpus, "usd_h": p.usd_h, "capacity_rps": _num(p.capacity_rps),
            "binding": p.binding, "reachable": p.reachable}


def _num(v: float) -> float | None:
    return v if math.isfinite(v) else None


def capacity_disagg(args: argparse.Namespace, profile: Any, workload: Any, extra: list[str],
                    _err: Callable[[str], int]) -> int:
    """`fleetplan models capacity --disagg`; `_err` prints the command's error line and returns its code."""
    from fleetplan.models.disagg import disagg_capacity, pool_profiles
    from fleetplan.models.hardware import GPU_SPECS
    from fleetplan.models.mix import LengthMix, capacity_mix
    from fleetplan.planner.disagg_choice import choose_serving

    if args.rate is not None and not (math.isfinite(args.rate) and args.rate >= 0):
        return _err(f"--rate must be a rate >= 0, got {args.rate}")
    if not (math.isfinite(args.headroom) and args.headroom >= 0):
        return _err(f"--headroom must be >= 0, got {args.headroom}")
    spec = GPU_SPECS.get(profile.key.gpu)
    price = args.price_usd_h if args.price_usd_h is not None else (spec.list_price_usd_h if spec else 0.0)
    if not (math.isfinite(price) and price >= 0):
        return _err(f"--price-usd-h must be >= 0, got {price}")
    mix = LengthMix.single(workload.isl, workload.osl)
    link = _link(args.link, profile.key.gpu)
    slo = {"ttft_p99_ms": args.ttft_p99_ms, "itl_p99_ms": args.itl_p99_ms}
    agg = capacity_mix(profile, mix, **slo)
    dis = disagg_capacity(pool_profiles(profile), mix, **slo, link=link)
    if dis is None:
        return _err(f"{profile.key.label()}: KV bytes per token unknown (the model's architecture is not "
                    "known): no disaggregated capacity")
    choice = (choose_serving(profile, mix, args.rate, **slo, link=link, price_usd_h=price, headroom=args.headroom)
              if args.rate is not None else None)
    doc: dict[str, Any] = {
        "profile": profile.key.label(), "link": {"kind": link.kind.value, "gb_s": link.gb_s},
        "aggregated": _cap_doc(agg), "prefill": _cap_doc(dis.prefill), "decode": _cap_doc(dis.decode),
        "kv_transfer_p99_ms": dis.transfer_p99_ms, "decode_join_ms": dis.join_ms,
        "extrapolated": dis.extrapolated, "warnings": extra,
    }
    if choice is not None:
        d = choice.disaggregated
        assert d is not None and choice.flips is not None
        f = choice.flips
        doc["choice"] = {"rate_rps": args.rate, "chosen": choice.chosen.value, "slo_reachable": choice.slo_reachable,
                         "aggregated": _pool_doc(choice.aggregated), "prefill": _pool_doc(d.prefill),
                         "decode": _pool_doc(d.decode),
                         "flips": {"rate_rps": f.rate_rps, "isl_scale": f.isl_scale, "link_gb_s": f.link_gb_s}}
    if args.json:
        print(json.dumps(doc))
        return 0
    _print(doc, workload, dis, choice)
    return 0


def _print(doc: dict[str, Any], workload: Any, dis: Any, choice: Any) -> None:
    link = doc["link"]
    print(f"profile {doc['profile']}  isl={workload.isl:g} osl={workload.osl:g}  "
          f"KV over {link['kind']} ({link['gb_s']:g} GB/s per GPU)")
    for name, what in (("aggregated", "aggregated replica"), ("prefill", "prefill replica"),
                       ("decode", "decode replica")):
        c = doc[name]
        rps = "inf" if c["max_rps"] is None else f"{c['max_rps']:.3f}"
        floor = "" if c["floor_share"] is None else f"; p99 out of reach, {c['floor_share']:.1%} served idle"
        print(f"  {what:19} max {rps} req/s (binding: {c['binding']}{floor})")
    print(f"  KV transfer of the p99 prompt {dis.transfer_p99_ms:.1f} ms; the decode side's front end and first step "
          f"{dis.join_ms:.1f} ms")
    if dis.extrapolated and choice is None:  # else the choice's explanation says it
        print("  pools extrapolated from the aggregated profile (no disaggregated benchmark)")
    for w in doc["warnings"]:
        print(f"  warning: {w}")
    if choice is None:
        return
    from fleetplan.planner.disagg_choice import explain_lines

    print(f"at {doc['choice']['rate_rps']:g} req/s:")
    for line in explain_lines(choice):
        print(f"  {line}")

