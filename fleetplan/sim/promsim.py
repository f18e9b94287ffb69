"""The replay's Prometheus: the simulated engines' own series, scraped, stored and queried.

The daemon reads Prometheus through `controller/observe.py` (PromQL over HTTP) and hands the raw
answers to the pure decision path (`fleetplan.planner.cycle.observe`). The replay hands that path
the same raw answers, computed here from the simulated replicas' counters, gauges and histograms
(the bucket edges the real engines export, fleetplan.sim.core): one scrape per target every
`scrape_s`, each target at its own offset in the interval (`slot`: as Prometheus offsets a target
by a hash of its labels), visible `delay_s` later, each query answered over the same windows the
Observer asks.

Only the I/O is simulated; no rule of the planner lives here. The instant queries and the
evidence's are the descriptions of planner/queries.py (`Latest`, `Rate`, `Arrivals`, `Quantile`,
`HistogramRate`), evaluated here as controller/observe.py renders them to PromQL. What each query
returns:

- counters (`rate(x[w])`): per target, (last - first) / (t_last - t_first) over its samples in the
  window (Prometheus extrapolates to the window's edges; the difference is a few percent at the
  window's ends and is not a decision);
- gauges: the target's latest sample while it is a target (a removed target's gauges go stale);
- histograms: per-bucket rates summed by model (or by replica), cumulative `le` buckets (`_count`:
  the +Inf bucket's rate, `_sum`: the engine's sum of the observations), and the
  quantile queries by Prometheus' own histogram_quantile (the one implementation,
  fleetplan.planner.evidence.histogram_quantile);
- `up` and the window coverage (first/last sample time, samples) per current target; per target
  its arrival rate and its completions counter's latest value;
- the request-rate history and the burst query: `sum by (model) (rate(completions[w]))`, a rate per
  target from its own samples (a first sample is no increase), summed, over `max(window, step)` at
  `step` intervals and over the burst window.
"""

from __future__ import annotations

import bisect
import math
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from fleetplan.models.config_key import Role
from fleetplan.planner import evidence as ev
from fleetplan.planner.arrivals import ArrivalRate, arrival_rate
from fleetplan.planner.observation import Query, Readings, Sample, Series
from fleetplan.planner.queries import (
    EVIDENCE_QUERIES,
    QUERIES,
    ROLE_LABEL,
    Agg,
    Arrivals,
    By,
    EngineHistogram,
    EvidenceDescription,
    EvidenceQuery,
    HistogramRate,
    Latest,
    Leg,
    Part,
    Quantile,
    Rate,
    Window,
    evidence_of,
)
from fleetplan.sim.core import ITL_BUCKETS_S, LENGTH_BUCKETS, TPOT_BUCKETS_S, TTFT_BUCKETS_S

__all__ = ["Counters", "PromSim", "TargetScrape"]


class Counters:
    """One engine's exported series (what its /metrics shows), cumulative since it started."""

    __slots__ = ("completed", "gen_len", "gen_tokens", "itl", "prefix_hits", "prefix_queries", "prompt_len",
                 "prompt_tokens", "sums", "tpot", "ttft")

    def __init__(self) -> None:
        self.completed = 0.0
        self.prompt_tokens = 0.0
        self.gen_tokens = 0.0
        self.ttft = [0.0] * (len(TTFT_BUCKETS_S) + 1)  # per bucket (not cumulative); last = +Inf
        self.itl = [0.0] * (len(ITL_BUCKETS_S) + 1)  # one observation per token gap
        self.tpot = [0.0] * (len(TPOT_BUCKETS_S) + 1)  # one observation per request (its mean gap)
        self.prompt_len = [0.0] * (len(LENGTH_BUCKETS) + 1)
        self.gen_len = [0.0] * (len(LENGTH_BUCKETS) + 1)
        # the histograms' _sum series: ttft, tpot, prompt length, generation length
        self.sums = [0.0, 0.0, 0.0, 0.0]
        # vllm:prefix_cache_queries / _hits (prompt tokens looked up in / found in the prefix cache)
        self.prefix_queries = 0.0
        self.prefix_hits = 0.0


@dataclass(frozen=True)
class TargetScrape:
    t_s: float
    completed: float
    prompt_tokens: float
    gen_tokens: float
    running: float
    waiting: float
    kv: float
    ttft: tuple[float, ...]
    itl: tuple[float, ...]
    tpot: tuple[float, ...]
    prompt_len: tuple[float, ...]
    gen_len: tuple[float, ...]
    sums: tuple[float, ...]
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0


def _cumulative(edges: Sequence[float], counts: Sequence[float]) -> tuple[tuple[float, float], ...]:
    out = []
    acc = 0.0
    for j, c in enumerate(counts):
        acc += c
        out.append((float(edges[j]) if j < len(edges) else math.inf, acc))
    return tuple(out)


def _extrapolated_rate(ts: Sequence[float], vs: Sequence[float], start_s: float, end_s: float) -> float | None:
    """Prometheus' rate() of a counter over the range (start, end] from its samples in it
    (promql/functions.go extrapolatedRate): the increase, extrapolated to the range's edges by at
    most 1.1 average sample intervals (else half an interval), never below the counter's zero,
    divided by the range."""
    if len(ts) < 2 or end_s <= start_s:
        return None
    result = vs[-1] - vs[0]
    sampled = ts[-1] - ts[0]
    if sampled <= 0:
        return None
    avg = sampled / (len(ts) - 1)
    to_start = ts[0] - start_s
    to_end = end_s - ts[-1]
    if result > 0 and vs[0] >= 0:
        to_start = min(to_start, sampled * (vs[0] / result))
    threshold = avg * 1.1
    span = sampled + (to_start if to_start < threshold else avg / 2) + (to_end if to_end < threshold else avg / 2)
    return result * (span / sampled) / (end_s - start_s)


def _rate_factor(win: Sequence[TargetScrape], start_s: float, end_s: float) -> float | None:
    """What rate() multiplies a target's increase over the window by (its completions' extrapolation
    applied to every series of the target, histogram buckets included)."""
    if len(win) < 2:
        return None
    a, b = win[0], win[-1]
    inc = b.completed - a.completed
    r = _extrapolated_rate((a.t_s, b.t_s), (a.completed, b.completed), start_s, end_s)
    if r is None:
        return None
    if inc <= 0:  # nothing completed: every increase is 0, whatever the factor
        return 1.0 / (end_s - start_s)
    return r / inc


def _deriv(ts: Sequence[float], vs: Sequence[float]) -> float | None:
    """Prometheus' deriv(): the least-squares slope per second."""
    n = len(ts)
    if n < 2:
        return None
    mt = sum(ts) / n
    mv = sum(vs) / n
    den = sum((t - mt) ** 2 for t in ts)
    if den <= 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in zip(ts, vs, strict=True)) / den


def _arrival_parts(rule: ArrivalRate, win: Sequence[TargetScrape],
                   f: float) -> tuple[float, float | None, list[float]]:
    """One target's part of an arrival rate over its window: the completions' rate, the growth of
    its requests in the engine (None: a gauge has no deriv()), and the slopes found."""
    done = (getattr(win[-1], rule.completions.value) - getattr(win[0], rule.completions.value)) * f
    growth: float | None = 0.0
    slopes: list[float] = []
    ts = [x.t_s for x in win]
    for gauge in rule.in_engine:  # deriv() of each gauge (planner/arrivals.py)
        slope = _deriv(ts, [getattr(x, gauge.value) for x in win])
        if slope is None or growth is None:  # PromQL: no deriv, no sum: the completion rate
            growth = None
            continue
        slopes.append(slope)
        growth += slope
    return done, growth, slopes


# the described queries (planner/queries.py) by kind, in the table's order; a histogram's bucket
# edges (the engines' own: fleetplan.sim.core)
_LATEST = [(q, d) for q, d in QUERIES.items() if isinstance(d, Latest)]
_RATES = [(q, d) for q, d in QUERIES.items() if isinstance(d, Rate)]
_ARRIVALS = [(q, d) for q, d in QUERIES.items() if isinstance(d, Arrivals)]
_QUANTILES = [(q, d) for q, d in QUERIES.items() if isinstance(d, Quantile)]
_HISTOGRAMS = {EngineHistogram.TTFT: TTFT_BUCKETS_S, EngineHistogram.ITL: ITL_BUCKETS_S}
_QUANTILE_LEG = {d.histogram: d.leg for _, d in _QUANTILES}  # the targets each latency quantile reads
# the evidence's histograms too (planner/queries.py EVIDENCE_QUERIES), and where each histogram's
# _sum is kept (`Counters.sums`; the replay keeps no ITL _sum)
_EDGES = {**_HISTOGRAMS, EngineHistogram.TPOT: TPOT_BUCKETS_S, EngineHistogram.PROMPT_LEN: LENGTH_BUCKETS,
          EngineHistogram.GEN_LEN: LENGTH_BUCKETS}
_SUMS = {EngineHistogram.TTFT: 0, EngineHistogram.TPOT: 1, EngineHistogram.PROMPT_LEN: 2, EngineHistogram.GEN_LEN: 3}


def _role(labels: Mapping[str, str]) -> str:
    """A target's role label ("" when it serves whole requests)."""
    return labels.get(ROLE_LABEL, "")


def _increase(d: EvidenceDescription, a: TargetScrape, b: TargetScrape, f: float) -> list[float]:
    """A description's rate on one target, from the first (`a`) and last (`b`) scrapes of its window
    and the target's rate factor `f`: one value, or one per bucket (not cumulative) for the buckets."""
    if isinstance(d, Rate):
        return [(getattr(b, d.series.value) - getattr(a, d.series.value)) * f]
    xa, xb = getattr(a, d.histogram.value), getattr(b, d.histogram.value)
    if d.part is Part.BUCKET:
        return [(y - x) * f for x, y in zip(xa, xb, strict=True)]
    if d.part is Part.COUNT:  # the observations: the +Inf bucket
        return [(sum(xb) - sum(xa)) * f]
    i = _SUMS[d.histogram]
    return [(b.sums[i] - a.sums[i]) * f]


def _answer(d: EvidenceDescription, labels: Mapping[str, str], values: Sequence[float]) -> list[Sample]:
    """A group's samples of a description's answer: its value, or its cumulative buckets by `le`."""
    if isinstance(d, HistogramRate) and d.part is Part.BUCKET:
        return [Sample({**labels, "le": "+Inf" if le == math.inf else repr(le)}, v)
                for le, v in _cumulative(_EDGES[d.histogram], values)]
    return [Sample(labels, values[0])]


class PromSim:
    """Scrapes of the replay's targets and the Observer's queries answered from them."""

    def __init__(self, *, window_s: float, scrape_s: float, delay_s: float, history_s: float,
                 history_step_s: float, peak_window_s: float, epoch0_s: float,
                 length_window_s: float | None = None, offsets: int = 1) -> None:
        self.window_s = window_s
        self.offsets = max(1, offsets)
        self._slots: dict[str, int] = {}
        self.length_window_s = max(window_s, length_window_s or window_s)
        self.scrape_s = scrape_s
        self.delay_s = delay_s
        self.history_s = history_s
        self.history_step_s = history_step_s
        self.peak_window_s = peak_window_s
        self.epoch0_s = epoch0_s
        self.samples: dict[str, deque[TargetScrape]] = {}  # replica id -> its recent scrapes
        self.labels: dict[str, dict[str, str]] = {}  # replica id -> its target labels
        self.targets: set[str] = set()  # the current scrape targets (file_sd)
        # per target where requests enter: (t, its completions counter) at every scrape, kept for the
        # rate history and the burst query (`sum by (model) (rate(...))`: a rate per target, summed)
        self.target_done: dict[str, list[tuple[float, float]]] = {}
        self.model_targets: dict[str, list[str]] = {}  # model -> its targets in target_done
        self.model_first: dict[str, float] = {}  # model -> its first scrape
        self._history_done: dict[str, dict[float, float | None]] = {}  # model -> end -> final history rate
        # model -> (its first end, the final history points from there on, None where no rate)
        self._history_runs: dict[str, tuple[float, list[tuple[float, float] | None]]] = {}

    # ---- scraping ------------------------------------------------------------------------------
    def set_targets(self, targets: Iterable[tuple[str, str] | tuple[str, str, str]]) -> None:
        """The scrape targets now (replica id, model[, role]), as the file_sd targets the routing
        writes: a pool replica's carries its role (controller/observe.py ROLE_LABEL)."""
        self.targets = set()
        for rid, model, *role in targets:
            self.targets.add(rid)
            self.labels[rid] = {"replica": rid, "model": model}
            if role and role[0] != Role.AGGREGATED.value:
                self.labels[rid][ROLE_LABEL] = role[0]

    def slot(self, rid: str) -> int:
        """The target's scrape offset, one of `offsets` within the interval: a hash of its id, as
        Prometheus offsets each target by a hash of its labels (scrape/target.go), so a fleet's
        targets are not all read at one instant and a new replica's first scrape falls anywhere in
        the interval after its READY."""
        s = self._slots.get(rid)
        if s is None:
            s = self._slots[rid] = zlib.crc32(rid.encode()) % self.offsets
        return s

    def scrape(self, t_s: float, engines: Mapping[str, tuple[Counters, float, float, float]],
               sweep: bool = True) -> None:
        """One scrape of the current targets in `engines` (replica id -> (counters, running,
        waiting, kv usage) of an engine still running); `sweep`: also drop every target's samples
        too old for any query (else only the scraped targets')."""
        keep = self.length_window_s + 4 * self.scrape_s
        old = t_s - self.history_s - 2 * max(self.window_s, self.history_step_s) - self.scrape_s
        for rid, (c, running, waiting, kv) in sorted(engines.items()):
            if rid not in self.targets:
                continue
            dq = self.samples.setdefault(rid, deque())
            dq.append(TargetScrape(t_s, c.completed, c.prompt_tokens, c.gen_tokens, running, waiting, kv,
                                   tuple(c.ttft), tuple(c.itl), tuple(c.tpot), tuple(c.prompt_len),
                                   tuple(c.gen_len), tuple(c.sums), c.prefix_queries, c.prefix_hits))
            model = self.labels[rid]["model"]
            if Leg.ENTRY.counts(_role(self.labels[rid])):  # bursts and history: where requests enter
                done = self.target_done.get(rid)
                if done is None:
                    done = self.target_done[rid] = []
                    self.model_targets.setdefault(model, []).append(rid)
                    self.model_first.setdefault(model, t_s)
                done.append((t_s, c.completed))
                if len(done) > 64 and done[0][0] < old:
                    del done[: bisect.bisect_left(done, (old, -math.inf))]
        for rid in (list(self.samples) if sweep else [r for r in engines if r in self.samples]):
            dq = self.samples[rid]
            while dq and dq[0].t_s < t_s - keep:
                dq.popleft()
            if not dq:
                del self.samples[rid]
        if sweep:  # a target stopped long ago leaves the history
            for rids in self.model_targets.values():
                gone = [r for r in rids if self.target_done[r][-1][0] < old]
                for r in gone:
                    rids.remove(r)
                    del self.target_done[r]

    def preroll(self, model: str, arrivals: Sequence[tuple[float, int, int]], *, start_s: float, end_s: float) -> None:
        """A stand-in target for `model` that served `arrivals` (time, prompt tokens, output
        tokens; each counted done when it arrives) between `start_s` and `end_s`, scraped every
        `scrape_s`: what Prometheus holds about the traffic before a replay's t = 0, so that the
        warm start reads it through the same queries as every cycle."""
        rid = f"preroll/{model}"
        self.labels[rid] = {"replica": rid, "model": model}
        self.targets.add(rid)
        c = Counters()
        order = sorted(arrivals)
        j = 0
        len_edges = LENGTH_BUCKETS
        n = math.floor((end_s - start_s) / self.scrape_s)
        for k in range(n + 1):
            t = end_s - (n - k) * self.scrape_s
            while j < len(order) and order[j][0] <= t:
                _, p, o = order[j]
                c.completed += 1
                c.prompt_tokens += p
                c.gen_tokens += o
                c.prompt_len[bisect.bisect_left(len_edges, p)] += 1
                c.gen_len[bisect.bisect_left(len_edges, o)] += 1
                c.sums[2] += p
                c.sums[3] += o
                j += 1
            self.scrape(t, {rid: (c, 0.0, 0.0, 0.0)})

    # ---- queries -------------------------------------------------------------------------------
    def _window(self, rid: str, t_s: float, w: float) -> list[TargetScrape]:
        """A target's samples in the range (t - w, t] that Prometheus holds at t."""
        vis = t_s - self.delay_s
        return [x for x in self.samples.get(rid, ()) if t_s - w < x.t_s <= vis]

    def _wall(self, t_s: float) -> float:
        return self.epoch0_s + t_s

    def readings(self, t_s: float) -> Readings:
        """What `Observer.fetch` returns at simulated time `t_s` (wall = epoch0 + t): the described
        queries (planner/queries.py) evaluated as PromQL would on the scrapes, and the target,
        burst and history queries."""
        w = self.window_s
        res: dict[Query, list[Sample]] = {q: [] for q in Query}
        per_model: dict[Query, dict[str, float]] = {}  # query -> model -> its sum (Latest, Rate)
        counted: dict[Query, dict[str, float]] = {}  # Latest AVG: the samples summed
        arrivals: dict[Query, dict[str, tuple[float, float | None]]] = {}  # model -> (done, growth)
        buckets: dict[EngineHistogram, dict[str, list[float]]] = {h: {} for h in _HISTOGRAMS}
        vis = t_s - self.delay_s

        def add(acc: dict[Query, dict[str, float]], q: Query, model: str, v: float) -> None:
            d = acc.setdefault(q, {})
            d[model] = d.get(model, 0.0) + v

        for rid, dq in sorted(self.samples.items()):
            lab = self.labels[rid]
            model = lab["model"]
            role = _role(lab)  # a per-model query reads the targets of its leg (planner/queries.py Leg)
            win = self._window(rid, t_s, w)
            last = next((x for x in reversed(dq) if x.t_s <= vis), None)
            if rid in self.targets and last is not None:
                res[Query.UP].append(Sample(lab, 1.0))
                res[Query.UP_LAST_S].append(Sample(lab, self._wall(last.t_s)))
                for q, latest in _LATEST:
                    v = getattr(last, latest.series.value)
                    if latest.by is By.REPLICA:
                        res[q].append(Sample(lab, v))
                        continue
                    if not latest.leg.counts(role):
                        continue
                    add(per_model, q, model, v)
                    if latest.agg is Agg.AVG:
                        add(counted, q, model, 1.0)
                if win:
                    res[Query.UP_FIRST_S].append(Sample(lab, self._wall(win[0].t_s)))
                    res[Query.UP_SAMPLES].append(Sample(lab, float(len(win))))
            f = _rate_factor(win, t_s - w, t_s)
            if f is None:
                continue
            a, b = win[0], win[-1]
            for q, rate in _RATES:
                v = (getattr(b, rate.series.value) - getattr(a, rate.series.value)) * f
                if rate.by is By.REPLICA:
                    res[q].append(Sample(lab, v))
                elif rate.leg.counts(role):
                    add(per_model, q, model, v)
            parts: dict[ArrivalRate, tuple[float, float | None, list[float]]] = {}
            for q, arr in _ARRIVALS:
                if arr.rule not in parts:
                    parts[arr.rule] = _arrival_parts(arr.rule, win, f)
                done, growth, slopes = parts[arr.rule]
                if arr.by is By.REPLICA:
                    res[q].append(Sample(lab, arrival_rate(done, growth, arr.rule)))
                    continue
                if not arr.leg.counts(role):
                    continue
                m_done, m_growth = arrivals.setdefault(q, {}).get(model, (0.0, None))
                for slope in slopes:  # PromQL: each deriv() summed by model, as far as there is one
                    m_growth = (0.0 if m_growth is None else m_growth) + slope
                arrivals[q][model] = (m_done + done, m_growth)
            for h, acc in buckets.items():
                if not _QUANTILE_LEG[h].counts(role):
                    continue
                xa, xb = getattr(a, h.value), getattr(b, h.value)
                counts = acc.setdefault(model, [0.0] * len(xb))
                for j, (x, y) in enumerate(zip(xa, xb, strict=True)):
                    counts[j] += (y - x) * f
        for q, parts_of in arrivals.items():
            rule = QUERIES[q]
            assert isinstance(rule, Arrivals)
            for model, (done, growth) in sorted(parts_of.items()):
                res[q].append(Sample({"model": model}, arrival_rate(done, growth, rule.rule)))
        for q, sums in per_model.items():
            n = counted.get(q)
            for model, v in sorted(sums.items()):
                res[q].append(Sample({"model": model}, v / max(1.0, n[model]) if n is not None else v))
        for q, quantile in _QUANTILES:
            for model, counts in buckets[quantile.histogram].items():
                v = ev.histogram_quantile(quantile.q, _cumulative(_HISTOGRAMS[quantile.histogram], counts))
                if v is not None:
                    res[q].append(Sample({"model": model}, v))
        for model, peak in self._peaks(t_s).items():
            res[Query.PEAK_RATE].append(Sample({"model": model}, peak))
        return Readings(self._wall(t_s), {q: tuple(v) for q, v in res.items()}, self._history(t_s))

    def _model_rate(self, model: str, end_s: float, w: float, vis_s: float) -> float | None:
        """`sum by (model) (rate(completions[w]))` at `end`: per target where requests enter, rate()
        over (end - w, end] from its samples visible at `vis_s`, summed (None: no target has two)."""
        total: float | None = None
        top = min(end_s, vis_s)
        for rid in self.model_targets.get(model, ()):
            pts = self.target_done[rid]
            if pts[-1][0] <= end_s - w or pts[0][0] > top:
                continue
            lo = bisect.bisect_right(pts, (end_s - w, math.inf))
            hi = bisect.bisect_right(pts, (top, math.inf))
            if hi - lo < 2:
                continue
            win = pts[lo:hi]
            r = _extrapolated_rate([t for t, _ in win], [v for _, v in win], end_s - w, end_s)
            if r is not None:
                total = r if total is None else total + r
        return total

    def _peaks(self, t_s: float) -> dict[str, float]:
        """max_over_time(sum by model (rate(success[peak_window]))[window:peak_window/2])."""
        vis = t_s - self.delay_s
        step = max(1.0, float(round(self.peak_window_s) // 2))
        out: dict[str, float] = {}
        for model in self.model_targets:
            best: float | None = None
            k = 0
            while k * step < self.window_s:
                r = self._model_rate(model, t_s - k * step, self.peak_window_s, vis)
                if r is not None:
                    best = r if best is None else max(best, r)
                k += 1
            if best is not None:
                out[model] = best
        return out

    def _history(self, t_s: float) -> tuple[Series, ...]:
        vis = t_s - self.delay_s
        w = max(self.window_s, self.history_step_s)
        step = self.history_step_s
        n = int(self.history_s // step)
        out = []
        for model in sorted(self.model_targets):
            # no rate before the model's first scrape: a history of days is not walked from its start
            first = self.model_first.get(model, t_s)
            avail = min(n, int(max(0.0, t_s - first) // step) + 1)
            # a point whose window ends before the visible data does is final: read once, kept (a
            # replay of days reads 2,880 points per cycle and model, as the daemon keeps what it read)
            done = self._history_done.setdefault(model, {})

            def rate(end: float, model: str = model, done: dict[float, float | None] = done) -> float | None:
                key = round(end, 6)
                if key in done:
                    return done[key]
                r = self._model_rate(model, end, w, vis)
                if end <= vis:
                    done[key] = r
                return r

            pts: list[tuple[float, float]] = []
            kept = 0
            if t_s.is_integer() and step.is_integer() and abs(t_s) < 2.0**50:  # whole seconds: exact ends
                pts = self._final_points(model, t_s - avail * step, min(vis, t_s), step, rate)
                kept = len(self._history_runs[model][1])
            for k in range(avail - kept, -1, -1):
                end = t_s - k * step
                r = rate(end)
                if r is not None:
                    pts.append((self._wall(end), r))
            if len(done) > 2 * (n + 2):
                oldest = t_s - (n + 1) * step
                for key in [x for x in done if x < oldest]:
                    del done[key]
            if pts:
                out.append(Series({"model": model}, tuple(pts)))
        return tuple(out)

    def _final_points(self, model: str, start: float, last: float, step: float,
                      rate: Callable[[float], float | None]) -> list[tuple[float, float]]:
        """The history's final points from `start` to `last` (whole seconds): the run of them kept
        from the last cycle, extended by the newly final ones (each point read once, not per cycle)."""
        run_start, points = self._history_runs.get(model, (start, []))
        if run_start > start or (start - run_start) % step != 0:
            run_start, points = start, []
        del points[:int((start - run_start) // step)]
        del points[max(0, int((last - start) // step) + 1):]
        while start + len(points) * step <= last:
            end = start + len(points) * step
            r = rate(end)
            points.append(None if r is None else (self._wall(end), r))
        self._history_runs[model] = (start, points)
        return [p for p in points if p is not None]

    def evidence(self, t_s: float) -> ev.Evidence:
        """What `Observer._evidence` returns: the evidence queries (planner/queries.py
        `EVIDENCE_QUERIES`) evaluated as PromQL would on the scrapes, over their windows."""
        spans = {Window.RATE: self.window_s, Window.LENGTH: self.length_window_s}
        answers: dict[EvidenceQuery, list[Sample]] = {q: [] for q in EVIDENCE_QUERIES}
        per_model: dict[EvidenceQuery, dict[str, list[float]]] = {}  # query -> model -> its sums
        for rid in sorted(self.samples):
            lab = self.labels[rid]
            ends: dict[Window, tuple[TargetScrape, TargetScrape, float]] = {}
            for window, w in spans.items():
                win = self._window(rid, t_s, w)
                f = _rate_factor(win, t_s - w, t_s)
                if f is not None:
                    ends[window] = (win[0], win[-1], f)
            for q, d in EVIDENCE_QUERIES.items():
                end = ends.get(d.window)
                if end is None:
                    continue
                if d.by is By.MODEL and not d.leg.counts(_role(lab)):
                    continue
                values = _increase(d, *end)
                if d.by is By.REPLICA:
                    answers[q].extend(_answer(d, lab, values))
                    continue
                acc = per_model.setdefault(q, {}).setdefault(lab["model"], [0.0] * len(values))
                for j, v in enumerate(values):
                    acc[j] += v
        for q, models in per_model.items():
            for model, values in sorted(models.items()):
                answers[q].extend(_answer(EVIDENCE_QUERIES[q], {"model": model}, values))
        return evidence_of(answers, model_of=lambda labels: labels.get("model"), window_s=self.window_s,
                           length_window_s=self.length_window_s)
