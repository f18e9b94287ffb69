"""A trace rebuilt from what Prometheus holds of a fleet (no request log): the pure part.

`fleetplan trace from-prometheus` (harness/cli/trace_prom.py) reads, with the daemon's own PromQL
(controller/observe.py), per scrape step: the model's arrival rate; per length window: the engines'
prompt and output length histograms (`vllm:request_prompt_tokens`, `vllm:request_generation_tokens`)
with their `_sum`/`_count`, else the token counters' means; per step: the prefix cache's hit share in
prompt tokens. `trace_from_series` turns them into a trace:

- arrivals: in each step, a Poisson number of requests at the step's rate x step, at uniform times
  inside the step (what happened inside a step is not in the data);
- lengths: drawn from the window's histogram, placed inside their buckets as
  `planner.evidence.bucket_quantiles` places them (a within-bucket shape whose mean is the
  histogram's exact _sum/_count); a model without histograms (TensorRT-LLM exports none) gets the
  window's mean length for every request;
- prefix blocks (512-token blocks, Mooncake `hash_ids`): each request's first round(h x blocks)
  blocks come from one of a few shared prefixes, the rest are its own, so that one unlimited cache
  would hit the share h the fleet's counters report.

`LengthReport` states what the buckets leave open: each quantile's bucket bounds, the mean's source,
the share above the highest finite bucket.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleetplan.planner import evidence as ev
from fleetplan.sim.traces import Trace, TraceFormat, TraceRequest

BLOCK_TOKENS = 512  # Mooncake's block (the replay's prefix cache reads hash_ids in these)
DRAW_LEVELS = tuple((i + 0.5) / 1000.0 for i in range(1000))  # the quantile table lengths are drawn from
REPORT_LEVELS = (0.5, 0.9, 0.99)
SHARED_PREFIXES = 8  # distinct shared prefixes (system prompts, documents) behind the hit share

Buckets = tuple[tuple[float, float], ...]  # (le, cumulative count or rate); +Inf = math.inf


@dataclass(frozen=True)
class LengthWindow:
    """One length window ending at end_s: the histograms (None: not exported) and the exact means
    (from _sum/_count, else from the token counters; None: unknown)."""

    end_s: float
    prompt: Buckets | None
    output: Buckets | None
    prompt_mean: float | None
    output_mean: float | None


@dataclass(frozen=True)
class LengthReport:
    """What a length's buckets say over the whole range, and what they leave open."""

    kind: str  # "prompt" or "output"
    mean_tokens: float | None  # the drawn requests' mean
    mean_source: str  # "histogram _sum/_count", "token counters", "bucket midpoints (no _sum)" or "unknown"
    quantiles: tuple[ev.QuantileEstimate, ...]  # REPORT_LEVELS over every window pooled
    above_top_share: float  # requests in the +Inf bucket: drawn at the highest finite bound
    windows_without_histogram: int

    def to_json(self) -> dict[str, Any]:
        return {
            "mean_tokens": None if self.mean_tokens is None else round(self.mean_tokens, 1),
            "mean_source": self.mean_source,
            "quantiles": [{"q": e.q, "tokens": round(e.value, 1), "bucket": [e.lo, None if math.isinf(e.hi) else e.hi]}
                          for e in self.quantiles],
            "above_top_bucket_share": round(self.above_top_share, 5),
            "windows_without_histogram": self.windows_without_histogram,
        }

    def lines(self) -> list[str]:
        out = [f"{self.kind} lengths: mean {_fmt(self.mean_tokens)} tokens ({self.mean_source})"]
        for e in self.quantiles:
            hi = "inf" if math.isinf(e.hi) else f"{e.hi:g}"
            out.append(f"  p{e.q * 100:g}: {e.value:.0f} tokens, certainly in its bucket ({e.lo:g}, {hi}]; "
                       "where inside it is the placement's guess")
        if self.above_top_share > 0:
            out.append(f"  {self.above_top_share:.2%} above the highest finite bucket: drawn at its bound (too short)")
        if self.windows_without_histogram:
            out.append(f"  {self.windows_without_histogram} window(s) without a histogram: every request at the "
                       "window's mean (the spread is unknown)")
        return out


def _fmt(x: float | None) -> str:
    return "unknown" if x is None else f"{x:.0f}"


def _table(buckets: Buckets | None, mean: float | None) -> np.ndarray | None:
    """The 1,000-point quantile table of a histogram (None: no histogram); one value: the mean only."""
    if buckets is not None:
        est = ev.bucket_quantiles(DRAW_LEVELS, buckets, mean)
        if est:
            return np.array([max(1.0, e.value) for e in est])
    if mean is not None and math.isfinite(mean) and mean > 0:
        return np.array([mean])
    return None


def _pooled(buckets: Sequence[Buckets]) -> Buckets:
    total: dict[float, float] = {}
    for b in buckets:
        for le, c in b:
            if math.isfinite(c):
                total[le] = total.get(le, 0.0) + c
    return tuple(sorted(total.items()))


def _report(kind: str, windows: Sequence[LengthWindow], drawn: np.ndarray) -> LengthReport:
    hists = [getattr(w, kind) for w in windows if getattr(w, kind) is not None]
    means = [getattr(w, f"{kind}_mean") for w in windows]
    pooled = _pooled(hists) if hists else ()
    counted = sorted(pooled)
    above = 0.0
    if counted and counted[-1][0] == math.inf and counted[-1][1] > 0:
        finite = [c for le, c in counted if math.isfinite(le)]
        above = max(0.0, 1.0 - (finite[-1] if finite else 0.0) / counted[-1][1])
    mean_known = [m for m in means if m is not None]
    source = ("histogram _sum/_count" if hists and len(mean_known) == len(windows) else
              "token counters" if not hists and mean_known else
              "bucket placement (no _sum)" if hists else "unknown")
    # each quantile: the drawn requests' value, and the bucket that certainly holds it
    bounds = ev.bucket_quantiles(REPORT_LEVELS, pooled) if pooled else ()
    q = tuple(ev.QuantileEstimate(e.q, float(np.quantile(drawn, e.q)), e.lo, e.hi) for e in bounds) if len(drawn) else ()
    return LengthReport(kind, float(drawn.mean()) if len(drawn) else None, source, q, above,
                        sum(1 for w in windows if getattr(w, kind) is None))


@dataclass(frozen=True)
class PromTrace:
    trace: Trace
    report: Mapping[str, Any]

    def lines(self) -> list[str]:
        return list(self.report["statement"])


def trace_from_series(rates: Sequence[tuple[float, float]], step_s: float, start_s: float,
                      windows: Sequence[LengthWindow], hit_share: Sequence[tuple[float, float]] | None,
                      seed: int, *, source: str = "prometheus", model: str | None = None) -> PromTrace:
    """The trace (module docstring). `rates`: (step end, arrivals/s) per step, NaN where unknown;
    `windows`: the length windows in time order; `hit_share`: (step end, prefix hit share) or None."""
    if not step_s > 0:
        raise ValueError(f"step_s must be > 0, got {step_s}")
    rng = np.random.default_rng(seed)
    ends = np.array([t for t, _ in rates], dtype=float)
    rps = np.array([r for _, r in rates], dtype=float)
    known = np.isfinite(rps) & (rps >= 0)
    counts = np.zeros(len(rps), dtype=np.int64)
    counts[known] = rng.poisson(rps[known] * step_s)
    t = np.repeat(ends - step_s, counts) + rng.uniform(0.0, step_s, size=int(counts.sum()))
    t = np.sort(t)
    n = len(t)
    # lengths, window by window (a request belongs to the first window ending at or after it)
    w_end = np.array([w.end_s for w in windows], dtype=float)
    which = np.minimum(np.searchsorted(w_end, t, side="left"), max(0, len(windows) - 1))
    prompt = np.zeros(n)
    output = np.zeros(n)
    for kind, dest in (("prompt", prompt), ("output", output)):
        tables = [_table(getattr(w, kind), getattr(w, f"{kind}_mean")) for w in windows]
        fallback = next((tb for tb in tables if tb is not None), None)
        if fallback is None:
            raise ValueError(f"{source}: no {kind} lengths in any window (no histogram, no token counters)")
        for wi in range(len(windows)):
            sel = np.flatnonzero(which == wi)
            table = tables[wi] if tables[wi] is not None else fallback
            if len(sel) and table is not None:
                dest[sel] = table[rng.integers(0, len(table), size=len(sel))]
    p_tok = np.maximum(1, np.rint(prompt)).astype(np.int64)
    o_tok = np.maximum(1, np.rint(output)).astype(np.int64)
    blocks = _prefix_blocks(t, p_tok, hit_share, step_s, rng) if hit_share is not None else None
    reqs = tuple(TraceRequest(t_s=round(float(t[i] - start_s), 6), prompt_tokens=int(p_tok[i]),
                              output_tokens=int(o_tok[i]), model=model,
                              blocks=None if blocks is None else blocks[i]) for i in range(n))
    trace = Trace(source=source, format=TraceFormat.MOONCAKE, requests=reqs)
    p_rep, o_rep = _report("prompt", windows, p_tok), _report("output", windows, o_tok)
    expected = float(np.sum(rps[known]) * step_s)
    missing = int((~known).sum())
    shares = [h for _, h in (hit_share or ()) if math.isfinite(h)]
    statement = [
        f"{n} requests over {len(rates)} steps of {step_s:g} s ({expected:.0f} expected from the rates; the count "
        "per step is Poisson at the step's rate)",
        f"arrivals inside a step are uniform: bursts shorter than {step_s:g} s are not in the data, so the "
        "trace's peaks over windows shorter than a few steps are smoothed",
    ]
    if missing:
        statement.append(f"{missing} step(s) without a rate (Prometheus had no samples): no arrivals there")
    statement += p_rep.lines() + o_rep.lines()
    if shares:
        statement.append(f"prefix cache: mean hit share {np.mean(shares):.3f} of prompt tokens (the fleet's, over "
                         f"its caches); which requests share what is not in the counters: {SHARED_PREFIXES} "
                         "synthetic shared prefixes carry it")
    else:
        statement.append("prefix cache: no counters; the requests carry no prefix blocks")
    report = {
        "requests": n, "steps": len(rates), "step_s": step_s, "steps_without_rate": missing,
        "expected_requests": round(expected, 1),
        "prompt": p_rep.to_json(), "output": o_rep.to_json(),
        "prefix_hit_share_mean": round(float(np.mean(shares)), 4) if shares else None,
        "statement": statement,
    }
    return PromTrace(trace, report)


def _prefix_blocks(t: np.ndarray, prompt: np.ndarray, hit_share: Sequence[tuple[float, float]], step_s: float,
                   rng: np.random.Generator) -> list[tuple[int, ...]]:
    """Blocks whose reuse share on one unlimited cache is the counters' hit share at each request's step."""
    ends = np.array([e for e, _ in hit_share], dtype=float)
    share = np.array([h for _, h in hit_share], dtype=float)
    share = np.where(np.isfinite(share), np.clip(share, 0.0, 1.0), 0.0)
    at = np.minimum(np.searchsorted(ends, t, side="left"), max(0, len(ends) - 1))
    h = share[at] if len(ends) else np.zeros(len(t))
    n_blocks = np.maximum(1, -(-prompt // BLOCK_TOKENS))
    want = h * n_blocks
    k = np.floor(want).astype(np.int64) + (rng.random(len(t)) < want - np.floor(want))  # stochastic rounding
    family = rng.integers(0, SHARED_PREFIXES, size=len(t))
    top = int(n_blocks.max()) if len(t) else 0
    # the shared prefixes' blocks: family f, position j -> f * top + j; the rest numbered after them
    next_id = SHARED_PREFIXES * top
    out: list[tuple[int, ...]] = []
    for i in range(len(t)):
        shared = [int(family[i]) * top + j for j in range(int(k[i]))]
        own = list(range(next_id, next_id + int(n_blocks[i] - k[i])))
        next_id += len(own)
        out.append(tuple(shared + own))
    return out
