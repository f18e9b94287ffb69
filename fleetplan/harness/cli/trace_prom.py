"""`fleetplan trace from-prometheus`: a model's traffic over a time range, rebuilt from the Prometheus
the daemon reads (no request log needed).

    fleetplan trace from-prometheus --prometheus URL --start T --end T --model M --out FILE
        [--step 60] [--length-window-s 3600] [--seed 0] [--selector 'job="engines"'] [--token-file F]

T: unix seconds, an ISO date-time (UTC unless it carries an offset) or now[-N{s,m,h,d}]. The queries are
the daemon's (controller/observe.py): the arrival rate (completions + queue growth) over each step,
the prompt/output length histograms with their _sum/_count (token counters for engines without
histograms) over each length window, the prefix cache's query and hit counters over each step.
fleetplan.sim.trace_prom builds the trace and states what the buckets leave open.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import sys
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MAX_POINTS = 10_000  # Prometheus refuses a range query of more than 11,000 points per series
_REL = re.compile(r"^now(?:-(\d+(?:\.\d+)?)([smhd]))?$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def register(sub: Any) -> None:
    p = sub.add_parser("from-prometheus", help="rebuild a model's traffic over a time range from Prometheus "
                                               "(rates per step, length histograms, prefix-cache counters)")
    p.add_argument("--prometheus", required=True, help="Prometheus base URL, e.g. http://prometheus:9090")
    p.add_argument("--start", required=True, help="unix seconds, ISO date-time, or now-7d")
    p.add_argument("--end", required=True, help="unix seconds, ISO date-time, or now")
    p.add_argument("--model", required=True, help="the model (its `model` or `model_name` label; spelling-insensitive)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--step", type=float, default=60.0,
                   help="seconds per rate step (at least two scrape intervals; default 60)")
    p.add_argument("--length-window-s", type=float, default=3600.0,
                   help="seconds per length-histogram window (default 3600)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--selector", default="", help='extra label matchers for every query, e.g. job="engines"')
    p.add_argument("--token-file", type=Path, default=None, help="a bearer token for Prometheus, read from this file")
    p.set_defaults(handler=_handle)


def parse_time(text: str, now_s: float) -> float:
    """Unix seconds, an ISO 8601 date-time (naive = UTC) or now[-N unit]."""
    s = text.strip()
    m = _REL.match(s)
    if m:
        return now_s - (float(m.group(1)) * _UNIT_S[m.group(2)] if m.group(1) else 0.0)
    try:
        return float(s)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"time {text!r}: not unix seconds, an ISO date-time or now-7d") from None
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()


def _handle(args: argparse.Namespace) -> int:
    from fleetplan.controller.observe import PrometheusError
    from fleetplan.harness.cli.trace import write_info, write_stream
    from fleetplan.sim.trace_build import jsonl_requests

    try:
        now = time.time()
        start, end = parse_time(args.start, now), parse_time(args.end, now)
        if not end > start:
            raise ValueError(f"--end {args.end!r} must be after --start {args.start!r}")
        if not args.step > 0 or not args.length_window_s > 0:
            raise ValueError(f"--step {args.step} and --length-window-s {args.length_window_s} must be > 0")
        token = args.token_file.read_text(encoding="utf-8").strip() if args.token_file else None
        built = asyncio.run(fetch_and_build(args.prometheus, start, end, args.model, step_s=args.step,
                                            length_window_s=args.length_window_s, seed=args.seed,
                                            selector=args.selector, token=token))
    except (ValueError, OSError, PrometheusError) as exc:
        print(f"fleetplan trace from-prometheus: {exc}", file=sys.stderr)
        return 2
    write_stream(args.out, jsonl_requests(built.trace.requests))
    info = {"kind": "prometheus", "prometheus": args.prometheus, "model": args.model, "start_s": start, "end_s": end,
            "seed": args.seed, "length_window_s": args.length_window_s, **dict(built.report)}
    side = write_info(args.out, info)
    print(f"{args.out}: from {args.prometheus}, model {args.model}, {start:.0f}..{end:.0f}; {side}")
    for line in built.lines():
        print(f"  {line}")
    return 0


def _matches(model: str) -> Callable[[Mapping[str, str]], bool]:
    from fleetplan.models.names import model_key
    from fleetplan.planner.observation import MODEL_LABELS, model_of

    want = model_key(model)

    def ok(labels: Mapping[str, str]) -> bool:
        name = model_of(labels, MODEL_LABELS)
        return name is not None and model_key(name) == want

    return ok


async def _range(client: Any, expr: str, start: float, end: float, step: float,
                 keep: Callable[[Mapping[str, str]], bool], by: str | None = None) -> dict[Any, dict[float, float]]:
    """Points of `expr` at start+step .. end (chunked under Prometheus' point limit), the kept series
    summed per timestamp (and per label `by`, e.g. `le`)."""
    out: dict[Any, dict[float, float]] = {}
    t = start + step
    while t <= end + 1e-6:
        stop = min(end, t + step * (MAX_POINTS - 1))
        for s in await client.query_range(expr, t, stop, step):
            if not keep(s.labels):
                continue
            key = s.labels.get(by) if by else None
            acc = out.setdefault(key, {})
            for ts, v in s.points:
                if math.isfinite(v):
                    acc[round(ts, 3)] = acc.get(round(ts, 3), 0.0) + v
        t = stop + step
    return out


async def fetch_and_build(url: str, start: float, end: float, model: str, *, step_s: float, length_window_s: float,
                          seed: int, selector: str = "", token: str | None = None) -> Any:
    """Read the range with the daemon's PromQL and build the trace (fleetplan.sim.trace_prom)."""
    from fleetplan.controller.observe import Observer, ObserverConfig, PromClient
    from fleetplan.planner.evidence import parse_le
    from fleetplan.planner.observation import Query
    from fleetplan.planner.queries import EvidenceQuery as Ev
    from fleetplan.sim.trace_prom import LengthWindow, trace_from_series

    keep = _matches(model)
    start, end = math.floor(start), math.floor(end)  # whole seconds: the steps' times match the answers'
    async with PromClient(url, timeout_s=60.0, token=token) as client:
        obs = Observer(client, ObserverConfig(window_s=step_s, length_window_s=length_window_s,
                                              extra_selector=selector))
        q, e = obs.queries(), obs.evidence_queries()
        rate = (await _range(client, q[Query.RATE], start, end, step_s, keep)).get(None, {})
        steps = [round(start + step_s * (i + 1), 3) for i in range(math.floor((end - start) / step_s + 1e-9))]
        if not rate:
            raise ValueError(f"{url}: no request rate for model {model!r} between {start:.0f} and {end:.0f} "
                             f"(query {q[Query.RATE]})")
        rates = [(t, rate.get(t, math.nan)) for t in steps]
        lw = length_window_s
        full = math.floor((end - start) / lw + 1e-9)
        w_ends = [round(start + lw * (i + 1), 3) for i in range(full)]
        if not w_ends or w_ends[-1] < end - 1e-3:
            w_ends.append(round(end, 3))  # the last, partial window (its rates over a full window)

        async def at_windows(expr: str, by: str | None = None) -> dict[Any, dict[float, float]]:
            """`expr` at each window's end: one range query, plus the last, partial window's end."""
            out = await _range(client, expr, start, end, lw, keep, by)
            if len(w_ends) > full:  # the last, partial window
                for s in await client.query(expr, w_ends[-1]):
                    if keep(s.labels) and math.isfinite(s.value):
                        acc = out.setdefault(s.labels.get(by) if by else None, {})
                        acc[w_ends[-1]] = acc.get(w_ends[-1], 0.0) + s.value
            return out

        hist = {k: await at_windows(e[k], "le") for k in (Ev.PROMPT_LEN, Ev.GEN_LEN)}
        mom = {k: await at_windows(e[k]) for k in (Ev.PROMPT_SUM, Ev.PROMPT_COUNT, Ev.GEN_SUM, Ev.GEN_COUNT)}
        # the token counters' means per length window (engines without length histograms)
        q_lw = Observer(client, ObserverConfig(window_s=lw, extra_selector=selector)).queries()
        tok = {k: await at_windows(q_lw[k]) for k in (Query.RATE, Query.PROMPT, Query.GEN)}
        hits = (await _range(client, q[Query.PREFIX_HITS], start, end, step_s, keep)).get(None, {})
        queries = (await _range(client, q[Query.PREFIX_QUERIES], start, end, step_s, keep)).get(None, {})

    def buckets(kind: Ev, t: float) -> tuple[tuple[float, float], ...] | None:
        pts = [(parse_le(le), v[t]) for le, v in hist[kind].items() if t in v]
        clean = tuple(sorted((le, c) for le, c in pts if le is not None))
        return clean if clean and sum(c for _, c in clean) > 0 else None

    def ratio(num: Mapping[float, float] | None, den: Mapping[float, float] | None, t: float) -> float | None:
        if not num or not den or t not in num or t not in den or den[t] <= 0:
            return None
        return num[t] / den[t]

    windows = []
    for t in w_ends:
        pm = ratio(mom[Ev.PROMPT_SUM].get(None), mom[Ev.PROMPT_COUNT].get(None), t)
        om = ratio(mom[Ev.GEN_SUM].get(None), mom[Ev.GEN_COUNT].get(None), t)
        if pm is None:
            pm = ratio(tok[Query.PROMPT].get(None), tok[Query.RATE].get(None), t)
        if om is None:
            om = ratio(tok[Query.GEN].get(None), tok[Query.RATE].get(None), t)
        windows.append(LengthWindow(t, buckets(Ev.PROMPT_LEN, t), buckets(Ev.GEN_LEN, t), pm, om))
    share: list[tuple[float, float]] | None = None
    if queries:
        share = [(t, hits.get(t, 0.0) / queries[t]) for t in steps if queries.get(t, 0.0) > 0]
    return trace_from_series(rates, step_s, start, windows, share or None, seed, source=f"{url} {model}")

