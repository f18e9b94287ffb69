"""Trace generators: day and week traces on a real week's shape, and a bursty coding-like hour.

Pure functions of their inputs and a seed (numpy's default_rng): the same arguments give the same
trace, byte for byte. The command line is `fleetplan trace build | coding` (harness/cli/trace.py);
docs/sim.md ("Traces") says what is real and what is synthetic in each.

**Day and week on a real week's shape** (`build_on_shape`). The expected arrivals of output minute k are

    target_k = base x E_k x M_k

- E is the week's rate (`read_week_rate`: the Azure conversation service, 2024-05-12..19, the median
  of each 7.2-minute column), interpolated to minutes, periodic over the week, mean 1 over the span
  (`envelope`); a day is one of its seven days.
- M is the source log's own minute-to-minute modulation (`source_log`): its per-minute counts over
  their 15-minute moving mean (the slower changes are the envelope's), shrunk toward 1 by the share
  of their variance that is the source's Poisson counting noise, and resampled in 15-minute blocks
  (circular block bootstrap) so its autocorrelation inside a block is the source's.
- base makes the span's mean rate `mean_rps`.

The requests themselves come from the source log, minute by minute: L "lanes" each walk through the
source's minutes in order from a random start (a new random start at each pass), and output minute k
offers the union of the lanes' current source minutes, each request at its own second within the
minute, with its own prompt, output and prefix blocks. A share p_k = target_k / offered of them is
kept, decided per conversation (the first block of a request that is not a shared system prompt,
`traces.shared_blocks`): a conversation's turns are kept or dropped together, so the prefix reuse of
the kept ones is the source's. Lanes are independent user populations: each lane and pass has its own
block ids (shared system-prompt blocks excepted), so no request hits a block of another lane's copy.
A source whose timestamps are coarse (Mooncake: batches every ~3 s) has its arrivals spread uniformly
over one grain.

**A coding-like hour** (`coding_hour`), from mechanisms, not from a log: developers' edit bursts
(clusters of completions a few seconds apart, Neyman-Scott) arriving at a rate raised by burst
episodes (automated clients, a team acting at once: starts uniform over the hour, lognormal durations,
heavy-tailed Pareto amplitudes). The episodes' amplitude is scaled so that the intensity's highest
aligned 60 s window is `peak_to_mean_60s` x its mean: the burstiness is a parameter. Prompts are an
IDE plugin's: a scaffold (instructions) plus the file context around the cursor (lognormal, one per
edit burst: the requests of a burst work on one file), capped by the model's context minus the
output reservation; outputs are completions: a line (geometric) or a block (lognormal), capped by
max_tokens.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from fleetplan.sim.traces import Trace, TraceError, TraceFormat, TraceRequest, shared_blocks

MINUTE_S = 60.0
DAY_MINUTES = 1440
WEEK_MINUTES = 7 * DAY_MINUTES
TREND_MINUTES = 15  # the source's slower changes belong to the envelope (7.2-min columns, interpolated)
BOOTSTRAP_BLOCK_MINUTES = 15  # the modulation is resampled in blocks this long
DEFAULT_DAY = 2  # the week starts on Sunday 2024-05-12: day 2 is Tuesday 05-14, a weekday
COARSE_ZERO_GAP_SHARE = 0.5  # a source with more equal timestamps than this has coarse timestamps
_WEEK_FIELDS = ("minute_start", "rpm_min", "rpm_median", "rpm_max")


class Shape(StrEnum):
    WEEK = "week"
    DAY = "day"


# ----------------------------------------------------------------------------------------------
# The week's rate
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class WeekRate:
    """A week's request rate in columns (requests per minute): the band's low, middle and high."""

    source: str
    minute_start: np.ndarray
    rpm_min: np.ndarray
    rpm_median: np.ndarray
    rpm_max: np.ndarray

    @property
    def column_minutes(self) -> float:
        return float(np.median(np.diff(self.minute_start)))


def parse_week_rate(text: str, source: str) -> WeekRate:
    """Parse `minute_start,rpm_min,rpm_median,rpm_max` rows (see read_week_rate)."""
    reader = csv.reader(io.StringIO(text))
    try:
        header = [h.strip().lstrip("\ufeff") for h in next(reader)]
    except StopIteration:
        raise TraceError(f"{source}: empty week-rate file") from None
    missing = [f for f in _WEEK_FIELDS if f not in header]
    if missing:
        raise TraceError(f"{source}:1: header {header!r} lacks {missing} (expected {','.join(_WEEK_FIELDS)})")
    col = {f: header.index(f) for f in _WEEK_FIELDS}
    rows: list[tuple[float, ...]] = []
    for row in reader:
        if not row or all(not c.strip() for c in row):
            continue
        vals = []
        for f in _WEEK_FIELDS:
            raw = row[col[f]] if col[f] < len(row) else None
            try:
                v = float(raw) if raw is not None else math.nan
            except ValueError:
                v = math.nan
            if not math.isfinite(v) or v < 0:
                raise TraceError(f"{source}:{reader.line_num}: field {f!r} = {raw!r}: must be a finite number >= 0")
            vals.append(v)
        if not vals[1] <= vals[2] <= vals[3]:
            raise TraceError(f"{source}:{reader.line_num}: field 'rpm_median' = {vals[2]!r}: must lie in "
                             f"[rpm_min {vals[1]!r}, rpm_max {vals[3]!r}]")
        if rows and vals[0] <= rows[-1][0]:
            raise TraceError(f"{source}:{reader.line_num}: field 'minute_start' = {vals[0]!r}: must increase")
        if vals[0] >= WEEK_MINUTES:
            raise TraceError(f"{source}:{reader.line_num}: field 'minute_start' = {vals[0]!r}: beyond a week "
                             f"({WEEK_MINUTES} minutes)")
        rows.append(tuple(vals))
    if len(rows) < 2:
        raise TraceError(f"{source}: {len(rows)} rows; a week's rate needs at least 2")
    a = np.array(rows)
    if float(a[:, 2].max()) <= 0:
        raise TraceError(f"{source}: field 'rpm_median' is 0 in every row")
    return WeekRate(source, a[:, 0], a[:, 1], a[:, 2], a[:, 3])


def read_week_rate(path: str | Path) -> WeekRate:
    """Read a week's rate file (data/traces/azure_llm_conv_2024_week_rate.csv, data/SOURCES.md)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{p}: cannot read week rate ({exc.strerror or exc})") from None
    return parse_week_rate(text, str(p))


def envelope(week: WeekRate, shape: Shape, day: int = DEFAULT_DAY) -> np.ndarray:
    """The relative rate per minute of a day (1,440 values) or the week (10,080), mean 1: the columns'
    medians at their centres, linearly interpolated to minute centres, periodic over the week."""
    if shape is Shape.DAY and not 0 <= day < 7:
        raise ValueError(f"day must be 0 (Sunday) to 6, got {day}")
    centres = week.minute_start + week.column_minutes / 2.0
    rate = np.interp(np.arange(WEEK_MINUTES) + 0.5, centres, week.rpm_median, period=WEEK_MINUTES)
    span = rate if shape is Shape.WEEK else rate[day * DAY_MINUTES:(day + 1) * DAY_MINUTES]
    mean = float(span.mean())
    if mean <= 0:
        raise ValueError(f"{week.source}: the rate is 0 all over the {shape.value}")
    return np.asarray(span / mean)


def hourly_swing(env: np.ndarray) -> float:
    """Peak-to-trough of an envelope's hourly means (the figure a service's daily swing is quoted in:
    the Azure conversation service's Tuesday 1.97x, its week 3.5x; a coding service's 31x)."""
    hours = np.asarray(env[: len(env) // 60 * 60], dtype=float).reshape(-1, 60).mean(axis=1)
    if not len(hours) or float(hours.min()) <= 0.0:
        raise ValueError("the envelope needs whole hours with a rate above 0")
    return float(hours.max() / hours.min())


def deepened(env: np.ndarray, swing: float) -> np.ndarray:
    """The same envelope with its hourly peak-to-trough made `swing`: every minute raised to one power
    p (found by bisection), then the mean set to 1 again. The hours keep their order, timing and the
    minutes inside them their ranking; only the depth between night and afternoon changes. A real
    week's timing at another service's depth: the week's shape at 3.5x is a conversation service's,
    a coding service's nights fall to 1/31 of its afternoons (p ~2.7 on that week).

    >>> env = np.repeat([1.0, 2.0, 3.0], 60)
    >>> round(hourly_swing(env), 2), round(hourly_swing(deepened(env, 9.0)), 2)
    (3.0, 9.0)
    >>> round(float(deepened(env, 9.0).mean()), 6)
    1.0
    """
    if not swing >= 1.0:
        raise ValueError(f"the swing is a peak-to-trough ratio, >= 1; got {swing}")
    base = hourly_swing(env)
    if base <= 1.0 + 1e-12:
        if swing > 1.0 + 1e-9:
            raise ValueError("a flat envelope has no shape to deepen")
        return np.asarray(env / float(np.mean(env)))
    lo, hi = 0.0, 1.0
    while hourly_swing(np.power(env, hi)) < swing:  # the swing grows with p (p = 0: flat)
        lo, hi = hi, 2.0 * hi
        if hi > 1024.0:
            raise ValueError(f"the envelope cannot reach a swing of {swing}")
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if hourly_swing(np.power(env, mid)) < swing else (lo, mid)
    out = np.power(env, 0.5 * (lo + hi))
    return np.asarray(out / float(out.mean()))


# ----------------------------------------------------------------------------------------------
# The source log
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SourceLog:
    """A request log prepared for resampling (source_log)."""

    trace: Trace
    minutes: int  # full minutes used (requests after the last full minute are not)
    starts: np.ndarray  # index of the first request of each minute, len minutes + 1
    offset_s: np.ndarray  # each request's time within its minute
    grain_s: float  # the timestamps' grain when coarse (spread over it), else 0
    modulation: np.ndarray  # per minute: relative rate over the 15-min trend, counting noise shrunk out
    session: np.ndarray  # per request: its conversation key (int64)
    shared: frozenset[int]
    block_span: int  # largest block id + 1 (0: no blocks)
    modulation_cv: float  # the modulation's coefficient of variation (after the shrink)
    raw_cv: float  # the per-minute counts' CV over the trend, before the shrink
    poisson_cv: float  # the part of it a Poisson process at the same rate would give


def _moving_mean(x: np.ndarray, k: int) -> np.ndarray:
    k = max(1, min(k, len(x)) | 1)  # odd, at most the series
    h = k // 2
    padded = np.pad(x, (h, h), mode="reflect") if h < len(x) else np.pad(x, (h, h), mode="edge")
    return np.convolve(padded, np.ones(k) / k, mode="valid")


def source_log(trace: Trace, *, trend_minutes: int = TREND_MINUTES) -> SourceLog:
    """Per-minute structure of a request log: counts, offsets, the modulation, conversation keys."""
    reqs = trace.requests
    t = np.array([r.t_s for r in reqs], dtype=float)
    minutes = int(t[-1] // MINUTE_S) if len(t) else 0
    if minutes < 3:
        raise TraceError(f"{trace.source}: {len(t)} requests over {t[-1] if len(t) else 0:.0f} s; resampling "
                         "needs at least 3 full minutes")
    n = int(np.searchsorted(t, minutes * MINUTE_S, side="left"))
    t = t[:n]
    minute = (t // MINUTE_S).astype(np.int64)
    starts = np.searchsorted(minute, np.arange(minutes + 1), side="left")
    counts = np.diff(starts).astype(float)
    gaps = np.diff(t)
    grain = 0.0
    if len(gaps) and float((gaps == 0).mean()) > COARSE_ZERO_GAP_SHARE:
        grain = float(np.median(gaps[gaps > 0])) if (gaps > 0).any() else 0.0
    trend = np.maximum(_moving_mean(counts, trend_minutes), 1e-9)
    ratio = counts / trend
    raw_var = float(ratio.var())
    poisson_var = float(np.mean(1.0 / trend))
    shrink = math.sqrt(max(0.0, 1.0 - poisson_var / raw_var)) if raw_var > 0 else 0.0
    mod = np.maximum(1.0 + shrink * (ratio - 1.0), 0.05)
    mod = mod / mod.mean()
    shared = shared_blocks(reqs[:n])
    has_blocks = any(r.blocks for r in reqs[:n])
    session = np.arange(n, dtype=np.int64)
    span = 0
    if has_blocks:
        span = 1 + max(h for r in reqs[:n] for h in (r.blocks or ()))
        for i, r in enumerate(reqs[:n]):
            key = next((h for h in (r.blocks or ()) if h not in shared), None)
            session[i] = key + n if key is not None else i  # block keys above the request indices
    return SourceLog(trace=trace, minutes=minutes, starts=starts, offset_s=t - minute * MINUTE_S, grain_s=grain,
                     modulation=mod, session=session, shared=shared, block_span=span,
                     modulation_cv=float(mod.std()), raw_cv=math.sqrt(raw_var), poisson_cv=math.sqrt(poisson_var))


# ----------------------------------------------------------------------------------------------
# Building on a shape
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class BuiltTrace:
    """Arrivals as arrays (a week of millions of requests is not built as objects): request j arrives
    at t_s[j] and is source request index[j], its non-shared blocks moved to namespace[j]."""

    source: SourceLog
    t_s: np.ndarray
    index: np.ndarray
    namespace: np.ndarray
    info: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __len__(self) -> int:
        return len(self.t_s)

    def blocks(self, j: int) -> tuple[int, ...] | None:
        r = self.source.trace.requests[int(self.index[j])]
        ns = int(self.namespace[j])
        if r.blocks is None or ns == 0:
            return r.blocks
        shift, shared = ns * self.source.block_span, self.source.shared
        return tuple(h if h in shared else h + shift for h in r.blocks)

    def requests(self, model: str | None = None) -> Iterator[TraceRequest]:
        reqs = self.source.trace.requests
        for j, (t, i) in enumerate(zip(self.t_s.tolist(), self.index.tolist(), strict=True)):
            r = reqs[i]
            yield TraceRequest(t_s=t, prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens,
                               model=model, blocks=self.blocks(j))

    def to_trace(self, source: str, model: str | None = None) -> Trace:
        return Trace(source=source, format=TraceFormat.MOONCAKE, requests=tuple(self.requests(model)))


def jsonl_line(t_s: float, prompt_tokens: int, output_tokens: int, blocks: Sequence[int] | str | None) -> str:
    """One Mooncake JSONL line (`timestamp` in ms, `hash_ids` only where there are blocks; `blocks` may
    come already joined with ", ")."""
    line = f'{{"timestamp": {t_s * 1000.0:.3f}, "input_length": {prompt_tokens}, "output_length": {output_tokens}'
    if blocks is not None:
        line += ', "hash_ids": [' + (blocks if isinstance(blocks, str) else ", ".join(map(str, blocks))) + "]"
    return line + "}\n"


def jsonl_requests(requests: Iterable[TraceRequest], chunk: int = 50_000) -> Iterator[str]:
    """Requests as Mooncake JSONL, in chunks of `chunk` lines: what `fleetplan evaluate --trace` reads."""
    buf: list[str] = []
    for r in requests:
        buf.append(jsonl_line(r.t_s, r.prompt_tokens, r.output_tokens, r.blocks))
        if len(buf) >= chunk:
            yield "".join(buf)
            buf = []
    if buf:
        yield "".join(buf)


def jsonl_chunks(built: BuiltTrace, chunk: int = 50_000) -> Iterator[str]:
    """A built trace as Mooncake JSONL (jsonl_line's format), in chunks of `chunk` lines; the block ids
    of a chunk are moved to their namespaces in one array operation."""
    reqs = built.source.trace.requests
    prompt = [r.prompt_tokens for r in reqs]
    output = [r.output_tokens for r in reqs]
    has = [r.blocks is not None for r in reqs]
    n_blk = np.array([len(r.blocks or ()) for r in reqs], dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(n_blk)])
    flat = np.array([h for r in reqs for h in (r.blocks or ())], dtype=np.int64)
    movable = np.array([h not in built.source.shared for r in reqs for h in (r.blocks or ())], dtype=np.int64)
    span = built.source.block_span
    for a in range(0, len(built), chunk):
        idx = built.index[a:a + chunk]
        lens = n_blk[idx]
        ends = np.cumsum(lens)
        pos = np.repeat(first[idx] - (ends - lens), lens) + np.arange(int(ends[-1]) if len(ends) else 0)
        ids = flat[pos] + movable[pos] * np.repeat(built.namespace[a:a + chunk] * span, lens)
        text = list(map(str, ids.tolist()))
        lines = []
        for t, i, e, n in zip(built.t_s[a:a + chunk].tolist(), idx.tolist(), ends.tolist(), lens.tolist(),
                              strict=True):
            lines.append(jsonl_line(t, prompt[i], output[i], ", ".join(text[e - n:e]) if has[i] else None))
        yield "".join(lines)


def _bootstrap(x: np.ndarray, n: int, block: int, rng: np.random.Generator) -> np.ndarray:
    """n values of x resampled in circular blocks of `block` consecutive values from random starts."""
    block = max(1, min(block, len(x)))
    nb = math.ceil(n / block)
    starts = rng.integers(0, len(x), size=nb)
    idx = (starts[:, None] + np.arange(block)[None, :]) % len(x)
    return np.asarray(x[idx.ravel()[:n]])


def _uniform(keys: np.ndarray, salt: int) -> np.ndarray:
    """A uniform in [0, 1) per key, fixed by (key, salt): splitmix64's finaliser."""
    with np.errstate(over="ignore"):
        z = keys.astype(np.uint64) + np.uint64(salt) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return np.asarray((z >> np.uint64(11)).astype(np.float64) / float(1 << 53))


def build_on_shape(source: SourceLog, relative_rate: np.ndarray, mean_rps: float, seed: int) -> BuiltTrace:
    """Arrivals over len(relative_rate) minutes whose expected count per minute follows
    relative_rate x the source's resampled modulation, mean `mean_rps` (module docstring)."""
    if not mean_rps > 0:
        raise ValueError(f"mean_rps must be > 0, got {mean_rps}")
    rel = np.asarray(relative_rate, dtype=float)
    if rel.ndim != 1 or len(rel) == 0 or not np.all(np.isfinite(rel)) or (rel < 0).any() or rel.sum() <= 0:
        raise ValueError("relative_rate must be a non-empty series of finite rates >= 0, not all 0")
    rng = np.random.default_rng(seed)
    k_total = len(rel)
    mod = _bootstrap(source.modulation, k_total, BOOTSTRAP_BLOCK_MINUTES, rng)
    target = rel * mod
    target *= mean_rps * MINUTE_S * k_total / target.sum()
    counts = np.diff(source.starts)
    s = source.minutes
    low = max(1.0, float(np.percentile(counts, 5)))
    lanes = max(1, math.ceil(float(target.max()) / low))
    passes = k_total // s + 1
    start = rng.integers(0, s, size=(lanes, passes))
    salt = rng.integers(1, 2**62, size=(lanes, passes))
    i_parts: list[np.ndarray] = []
    ns_parts: list[np.ndarray] = []
    k_parts: list[np.ndarray] = []
    short = 0.0
    for k in range(k_total):
        c, pos = divmod(k, s)
        offers: list[tuple[np.ndarray, np.ndarray, int]] = []
        for lane in range(lanes):
            j = (int(start[lane, c]) + pos) % s
            a, b = int(source.starts[j]), int(source.starts[j + 1])
            if b > a:
                idx = np.arange(a, b)
                offers.append((idx, _uniform(source.session[idx], int(salt[lane, c])), lane * passes + c))
        offered = sum(len(o[0]) for o in offers)
        p = float(target[k]) / offered if offered else math.inf
        if p > 1.0:
            short += float(target[k]) - offered
        for idx, u, ns in offers:
            kept = idx[u < p]
            if len(kept):
                i_parts.append(kept)
                ns_parts.append(np.full(len(kept), ns, dtype=np.int64))
                k_parts.append(np.full(len(kept), k, dtype=np.int64))
    index = np.concatenate(i_parts) if i_parts else np.zeros(0, dtype=np.int64)
    namespace = np.concatenate(ns_parts) if ns_parts else np.zeros(0, dtype=np.int64)
    minute_of = np.concatenate(k_parts) if k_parts else np.zeros(0, dtype=np.int64)
    offs = source.offset_s[index]
    if source.grain_s > 0:
        offs = offs + rng.random(len(offs)) * np.minimum(source.grain_s, MINUTE_S - offs)  # inside the minute
    t = minute_of * MINUTE_S + np.minimum(offs, MINUTE_S - 1e-6)
    order = np.argsort(t, kind="stable")
    info = {
        "minutes": k_total,
        "mean_rps_target": mean_rps,
        "requests": len(t),
        "lanes": lanes,
        "source_minutes": s,
        "source_grain_s": source.grain_s,
        "shortfall_requests": round(short, 1),
        "modulation_cv": round(source.modulation_cv, 4),
    }
    return BuiltTrace(source=source, t_s=np.round(t[order], 6), index=index[order], namespace=namespace[order],
                      info=MappingProxyType(info))


# ----------------------------------------------------------------------------------------------
# A coding-like hour
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CodingHour:
    """The mechanisms' parameters (module docstring); defaults are what an IDE assistant does."""

    duration_s: float = 3600.0
    mean_rps: float = 8.0
    peak_to_mean_60s: float = 4.1  # the intensity's highest aligned minute over its mean
    episodes_per_h: float = 3.0  # burst episodes (at least one: the peak is one)
    episode_median_s: float = 90.0
    episode_sigma: float = 0.5  # lognormal sigma of the episodes' durations
    episode_tail_alpha: float = 1.5  # Pareto index of their amplitudes (heavy-tailed)
    min_base_share: float = 0.1  # the rate outside episodes is at least this share of the mean
    burst_requests: float = 3.0  # mean completions per edit burst (geometric, >= 1)
    burst_gap_s: float = 2.0  # mean gap between the completions of a burst (exponential)
    context_tokens: int = 8192  # the model's context: prompt + max_tokens fit in it
    scaffold_tokens: int = 200  # instructions and the plugin's framing
    file_median_tokens: float = 1400.0  # the file context around the cursor (lognormal per burst)
    file_sigma: float = 0.9
    file_jitter: float = 0.05  # the context moves a little between the completions of a burst
    max_output_tokens: int = 256
    single_line_share: float = 0.6  # completions that stop at the end of the line
    single_line_mean_tokens: float = 10.0  # geometric
    block_median_tokens: float = 40.0  # multi-line completions: lognormal
    block_sigma: float = 0.8

    def check(self) -> None:
        positive = ("duration_s", "mean_rps", "episode_median_s", "episode_tail_alpha", "burst_gap_s",
                    "file_median_tokens", "single_line_mean_tokens", "block_median_tokens")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"CodingHour.{name} must be > 0, got {getattr(self, name)!r}")
        if not self.peak_to_mean_60s >= 1.0:
            raise ValueError(f"CodingHour.peak_to_mean_60s must be >= 1, got {self.peak_to_mean_60s!r}")
        if not self.burst_requests >= 1.0:
            raise ValueError(f"CodingHour.burst_requests must be >= 1, got {self.burst_requests!r}")
        if not 0.0 <= self.single_line_share <= 1.0:
            raise ValueError(f"CodingHour.single_line_share must be in [0, 1], got {self.single_line_share!r}")
        if self.context_tokens <= self.scaffold_tokens + self.max_output_tokens:
            raise ValueError(f"CodingHour.context_tokens {self.context_tokens} leaves no room for a file after "
                             f"scaffold_tokens {self.scaffold_tokens} and max_output_tokens {self.max_output_tokens}")


def coding_intensity(p: CodingHour, rng: np.random.Generator) -> np.ndarray:
    """The arrival intensity per second (requests/s, one value per second of the hour): a base rate
    plus the burst episodes, scaled so that its highest aligned 60 s mean is p.peak_to_mean_60s x its
    mean and its mean is p.mean_rps."""
    n_s = math.ceil(p.duration_s)
    n_ep = max(1, int(rng.poisson(p.episodes_per_h * p.duration_s / 3600.0)))
    shape = np.zeros(n_s)
    for _ in range(n_ep):
        start = rng.uniform(0.0, p.duration_s)
        dur = p.episode_median_s * math.exp(p.episode_sigma * float(rng.standard_normal()))
        amp = float(rng.pareto(p.episode_tail_alpha)) + 1.0
        a, b = int(start), min(n_s, math.ceil(start + dur))
        shape[a:b] += amp
    minutes = n_s // 60 if n_s >= 60 else 1
    binned = shape[:minutes * 60].reshape(minutes, -1).mean(axis=1) if n_s >= 60 else shape.mean(keepdims=True)
    gain = float(binned.max()) - float(shape.mean())
    if p.peak_to_mean_60s == 1.0 or gain <= 0:
        return np.full(n_s, p.mean_rps)
    # mean fixed: intensity = base + kappa x shape, base = mean - kappa x mean(shape); the peak minute
    # over the mean is 1 + kappa x gain / mean, linear in kappa
    kappa = (p.peak_to_mean_60s - 1.0) * p.mean_rps / gain
    base = p.mean_rps - kappa * float(shape.mean())
    if base < p.min_base_share * p.mean_rps:
        raise ValueError(f"CodingHour.peak_to_mean_60s {p.peak_to_mean_60s} with these episodes leaves a base rate "
                         f"of {base:.3f} rps, below min_base_share {p.min_base_share} x mean_rps {p.mean_rps}; "
                         "try another seed, fewer episodes_per_h or a lower peak")
    return np.asarray(base + kappa * shape)


def coding_hour(p: CodingHour, seed: int) -> Trace:
    """One coding-like hour (module docstring); the same (p, seed) gives the same trace."""
    p.check()
    rng = np.random.default_rng(seed)
    lam = coding_intensity(p, rng)
    m = p.burst_requests
    # edit bursts start at intensity / m (each brings m completions on average)
    per_s = rng.poisson(lam / m)
    starts = np.repeat(np.arange(len(lam), dtype=float), per_s) + rng.uniform(0.0, 1.0, size=int(per_s.sum()))
    sizes = rng.geometric(1.0 / m, size=len(starts))
    burst = np.repeat(np.arange(len(starts)), sizes)
    first = np.repeat(np.cumsum(sizes) - sizes, sizes)
    gaps = rng.exponential(p.burst_gap_s, size=len(burst))
    gaps[first == np.arange(len(burst))] = 0.0
    csum = np.cumsum(gaps)
    t = starts[burst] + csum - csum[first]
    # lengths: one file context per burst, moving a little between its completions
    cap = p.context_tokens - p.max_output_tokens - p.scaffold_tokens
    file_tokens = p.file_median_tokens * np.exp(p.file_sigma * rng.standard_normal(len(starts)))
    ctx = file_tokens[burst] * (1.0 + rng.uniform(-p.file_jitter, p.file_jitter, size=len(burst)))
    prompt = p.scaffold_tokens + np.clip(np.rint(ctx), 1, cap).astype(np.int64)
    line = rng.random(len(burst)) < p.single_line_share
    out_line = rng.geometric(1.0 / p.single_line_mean_tokens, size=len(burst))
    out_block = np.rint(p.block_median_tokens * np.exp(p.block_sigma * rng.standard_normal(len(burst))))
    output = np.clip(np.where(line, out_line, out_block), 1, p.max_output_tokens).astype(np.int64)
    keep = t < p.duration_s
    t, prompt, output = t[keep], prompt[keep], output[keep]
    order = np.argsort(t, kind="stable")
    reqs = tuple(TraceRequest(t_s=round(float(t[i]), 6), prompt_tokens=int(prompt[i]), output_tokens=int(output[i]))
                 for i in order.tolist())
    return Trace(source=f"coding-hour(seed={seed})", format=TraceFormat.MOONCAKE, requests=reqs)


def peak_to_mean(t_s: np.ndarray, window_s: float = MINUTE_S, duration_s: float | None = None) -> float:
    """The highest count in aligned windows of `window_s` over the mean count per window."""
    t = np.asarray(t_s, dtype=float)
    dur = float(t.max()) if duration_s is None else duration_s
    n = max(1, int(dur // window_s))
    counts = np.bincount(np.minimum((t // window_s).astype(np.int64), n - 1), minlength=n)[:n]
    return float(counts.max() / counts.mean()) if counts.mean() > 0 else math.nan
