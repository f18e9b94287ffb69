"""Request traces: readers for public LLM traces and day-shaping.

Formats (detected from the header / first line, never from the file name):

- Azure LLM inference trace CSV (AzurePublicDataset, 2023 and 2024):
  ``TIMESTAMP,ContextTokens,GeneratedTokens``; TIMESTAMP is an ISO date-time such as
  ``2023-11-16 18:15:46.6805900`` (up to 7 fractional digits, optional UTC offset).
- Mooncake JSONL (kvcache-ai/Mooncake FAST25 traces): one JSON object per line with
  ``timestamp`` (milliseconds), ``input_length``, ``output_length``, optional ``hash_ids`` (the
  prompt's 512-token blocks, chained: equal ids mean equal prefixes; kept as ``TraceRequest.blocks``).
- BurstGPT CSV: ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``;
  Timestamp in seconds. Rows with ``Response tokens`` = 0 are failed requests in BurstGPT: they
  are SKIPPED and counted in ``Trace.skipped`` (with the first reasons in ``Trace.skip_reasons``).

Any other bad row (missing field, not a number, negative, prompt of 0 tokens, output of 0 tokens
outside BurstGPT, a timestamp that does not parse) raises ``TraceError`` with one line naming
the file, the line number, the field and the value. Nothing is silently dropped.

Requests come out sorted by time (stable: ties keep file order) and shifted so that the first
request is at ``t_s = 0``.
"""

from __future__ import annotations

import contextlib
import csv
import gc
import io
import json
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from pathlib import Path

import numpy as np


class TraceError(ValueError):
    """A trace that cannot be read; the message names file, line, field and value."""


class TraceFormat(StrEnum):
    AZURE = "azure"
    MOONCAKE = "mooncake"
    BURSTGPT = "burstgpt"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace (slots: a week's replay holds millions of them)."""

    t_s: float  # arrival, seconds from the first request of the trace
    prompt_tokens: int
    output_tokens: int
    model: str | None = None  # None: the trace has no model column (one model)
    # the prompt's 512-token block hashes (Mooncake's hash_ids; fleetplan.sim.prefix_cache), None: unknown
    blocks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Trace:
    source: str
    format: TraceFormat
    requests: tuple[TraceRequest, ...]
    skipped: int = 0  # rows skipped on purpose (BurstGPT failed requests), see module doc
    skip_reasons: tuple[str, ...] = ()  # the first few, one line each

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        """Time of the last arrival (the first is at 0)."""
        return self.requests[-1].t_s if self.requests else 0.0

    def models(self) -> tuple[str | None, ...]:
        """Distinct model labels in order of first appearance."""
        seen: dict[str | None, None] = {}
        for r in self.requests:
            seen.setdefault(r.model, None)
        return tuple(seen)

    def as_single_model(self, model: str) -> Trace:
        """Every request relabelled as `model` (serve a multi-model trace as one model); the trace
        itself when every request already carries that label (a week's millions are not copied)."""
        if all(r.model == model for r in self.requests):
            return self
        return replace(self, requests=tuple(TraceRequest(r.t_s, r.prompt_tokens, r.output_tokens, model, r.blocks)
                                            for r in self.requests))

    def summary(self) -> dict[str, object]:
        n = len(self.requests)
        dur = self.duration_s
        reuse = block_reuse_share(self.requests)
        return {
            "block_reuse_share": round(reuse, 4) if reuse is not None else None,
            "source": self.source,
            "format": self.format.value,
            "requests": n,
            "skipped": self.skipped,
            "duration_s": round(dur, 3),
            "mean_rps": round(n / dur, 4) if dur > 0 else None,
            "mean_prompt_tokens": round(sum(r.prompt_tokens for r in self.requests) / n, 2) if n else None,
            "mean_output_tokens": round(sum(r.output_tokens for r in self.requests) / n, 2) if n else None,
            "models": [m for m in self.models() if m is not None],
        }


_MAX_SKIP_REASONS = 5


def _err(source: str, line: int, field: str, value: object, why: str) -> TraceError:
    return TraceError(f"{source}:{line}: field {field!r} = {value!r}: {why}")


def _int_field(source: str, line: int, field: str, raw: object, *, minimum: int) -> int:
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        raise _err(source, line, field, raw, "missing")
    if isinstance(raw, bool):
        raise _err(source, line, field, raw, "not a token count")
    try:
        if isinstance(raw, str):
            text = raw.strip()
            value_f = float(text)
        elif isinstance(raw, (int, float)):
            value_f = float(raw)
        else:
            raise ValueError
    except ValueError:
        raise _err(source, line, field, raw, "not a number") from None
    if not math.isfinite(value_f) or value_f != int(value_f):
        raise _err(source, line, field, raw, "not a whole token count")
    value = int(value_f)
    if value < minimum:
        raise _err(source, line, field, raw, f"must be >= {minimum}")
    return value


def _float_field(source: str, line: int, field: str, raw: object) -> float:
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        raise _err(source, line, field, raw, "missing")
    try:
        if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
            raise ValueError
        value = float(raw)
    except ValueError:
        raise _err(source, line, field, raw, "not a number") from None
    if not math.isfinite(value) or value < 0:
        raise _err(source, line, field, raw, "must be a finite number >= 0")
    return value


def _parse_datetime(source: str, line: int, field: str, raw: str | None) -> float:
    if raw is None or raw.strip() == "":
        raise _err(source, line, field, raw, "missing")
    text = raw.strip()
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise _err(source, line, field, raw, "not a date-time like 2023-11-16 18:15:46.6805900") from None
    if dt.tzinfo is not None:
        return dt.timestamp()
    # naive: read as UTC without touching the local time zone
    return (dt - datetime(1970, 1, 1)).total_seconds()


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", " ")


_AZURE_FIELDS = ("timestamp", "contexttokens", "generatedtokens")
_BURST_FIELDS = ("timestamp", "model", "request tokens", "response tokens")


def _detect(source: str, first_line: str) -> TraceFormat:
    stripped = first_line.strip().lstrip("\ufeff")
    if stripped.startswith("{"):
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError:
            raise TraceError(f"{source}:1: first line starts with '{{' but is not JSON") from None
        if isinstance(obj, dict) and {"timestamp", "input_length", "output_length"} <= set(obj):
            return TraceFormat.MOONCAKE
        raise TraceError(
            f"{source}:1: JSON lines without the Mooncake fields timestamp, input_length, output_length "
            f"(keys: {sorted(obj) if isinstance(obj, dict) else type(obj).__name__})"
        )
    header = [_norm(h) for h in next(csv.reader([stripped]))]
    if all(f in header for f in _AZURE_FIELDS):
        return TraceFormat.AZURE
    if all(f in header for f in _BURST_FIELDS):
        return TraceFormat.BURSTGPT
    raise TraceError(
        f"{source}:1: unknown trace header {stripped[:120]!r}; expected Azure "
        "'TIMESTAMP,ContextTokens,GeneratedTokens', BurstGPT "
        "'Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type' or Mooncake JSONL"
    )


def parse_trace_text(text: str, source: str, *, model: str | None = None) -> Trace:
    """Parse a trace given as text (see read_trace)."""
    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip()), None)
    if first is None:
        raise TraceError(f"{source}: empty trace")
    fmt = _detect(source, first)
    raw: list[tuple[float, int, int, str | None]] = []
    blocks: list[tuple[int, ...] | None] = []
    skipped = 0
    reasons: list[str] = []
    if fmt is TraceFormat.MOONCAKE:
        for lineno, ln in enumerate(lines, start=1):
            if not ln.strip():
                continue
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{source}:{lineno}: not a JSON object ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{source}:{lineno}: not a JSON object")
            t_ms = _float_field(source, lineno, "timestamp", obj.get("timestamp"))
            p = _int_field(source, lineno, "input_length", obj.get("input_length"), minimum=1)
            o = _int_field(source, lineno, "output_length", obj.get("output_length"), minimum=1)
            raw.append((t_ms / 1000.0, p, o, model))
            blocks.append(_hash_ids(source, lineno, obj.get("hash_ids"), p))
    else:
        reader = csv.reader(io.StringIO(text))
        header_row = next(reader)
        header = [_norm(h.lstrip("\ufeff")) for h in header_row]
        col = {name: i for i, name in enumerate(header)}
        names = {_norm(h.lstrip("\ufeff")): h.lstrip("\ufeff").strip() for h in header_row}
        for row in reader:
            lineno = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue

            def get(key: str, row: Sequence[str] = row) -> str | None:
                i = col[key]
                return row[i] if i < len(row) else None

            if fmt is TraceFormat.AZURE:
                t = _parse_datetime(source, lineno, names["timestamp"], get("timestamp"))
                p = _int_field(source, lineno, names["contexttokens"], get("contexttokens"), minimum=1)
                o = _int_field(source, lineno, names["generatedtokens"], get("generatedtokens"), minimum=1)
                raw.append((t, p, o, model))
            else:
                t = _float_field(source, lineno, names["timestamp"], get("timestamp"))
                m = (get("model") or "").strip()
                if not m:
                    raise _err(source, lineno, names["model"], get("model"), "missing")
                p = _int_field(source, lineno, names["request tokens"], get("request tokens"), minimum=0)
                o = _int_field(source, lineno, names["response tokens"], get("response tokens"), minimum=0)
                if o == 0 or p == 0:
                    skipped += 1
                    if len(reasons) < _MAX_SKIP_REASONS:
                        which = "Response tokens" if o == 0 else "Request tokens"
                        reasons.append(f"{source}:{lineno}: {which} = 0 (failed request), skipped")
                    continue
                raw.append((t, p, o, m))
    if not raw:
        raise TraceError(f"{source}: no requests ({skipped} rows skipped)")
    order = sorted(range(len(raw)), key=lambda i: raw[i][0])
    t0 = raw[order[0]][0]
    requests = tuple(
        TraceRequest(t_s=round(raw[i][0] - t0, 6), prompt_tokens=raw[i][1], output_tokens=raw[i][2], model=raw[i][3],
                     blocks=blocks[i] if blocks else None)
        for i in order
    )
    return Trace(source=source, format=fmt, requests=requests, skipped=skipped, skip_reasons=tuple(reasons))


def _hash_ids(source: str, line: int, raw: object, prompt_tokens: int) -> tuple[int, ...] | None:
    """A Mooncake line's hash_ids (absent or null: None). One id per 512-token block of the prompt;
    a list of another length is kept as it is (a trace from another block size) but must hold
    whole non-negative numbers."""
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in raw):
        raise _err(source, line, "hash_ids", raw if not isinstance(raw, list) else raw[:8],
                   "must be a list of block ids (whole numbers >= 0)")
    return tuple(raw)


def block_reuse_share(requests: Iterable[TraceRequest], capacity_blocks: int | None = None) -> float | None:
    """The share of the requests' prompt blocks that repeat an earlier block still in a cache of
    `capacity_blocks` blocks, least recently used evicted first (in arrival order): the
    prefix-cache hit rate in blocks of ONE replica with that cache (None: unlimited, the bound for
    any fleet: more replicas or a bounded cache hit less). A replica's cache is at most its KV
    memory (vLLM keeps freed blocks for reuse and evicts the least recently used), so the bound at
    that capacity is what GPU memory alone can reach. None when no request has blocks.
    Mooncake's conversation trace: 0.366 unlimited, 0.043 in the 430k tokens (840 blocks of 512)
    of one H100's KV cache for Llama-3-8B.

    >>> reqs = [TraceRequest(float(t), 1024, 1, "m", blocks=b) for t, b in enumerate([(1, 2), (3, 4), (1, 2)])]
    >>> block_reuse_share(reqs), block_reuse_share(reqs, capacity_blocks=2)
    (0.3333333333333333, 0.0)
    """
    cache: OrderedDict[int, None] = OrderedDict()
    total = repeat = 0
    for r in requests:
        if r.blocks is None:
            continue
        for h in r.blocks:
            total += 1
            if h in cache:
                repeat += 1
                cache.move_to_end(h)
            else:
                cache[h] = None
                if capacity_blocks is not None and len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    return repeat / total if total else None


def read_trace(path: str | Path, *, model: str | None = None) -> Trace:
    """Read an Azure CSV, Mooncake JSONL or BurstGPT CSV trace (format from the header).

    `model` labels the requests of a trace WITHOUT a model column (Azure, Mooncake); BurstGPT
    rows keep their own model (use ``Trace.as_single_model`` to serve them as one model).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{p}: cannot read trace ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise TraceError(f"{p}: not a UTF-8 text trace") from None
    return parse_trace_text(text, str(p), model=model)


# ----------------------------------------------------------------------------------------------
# Day shaping
# ----------------------------------------------------------------------------------------------

DEFAULT_DAY_AMPLITUDE = 0.5


def day_shape(x: np.ndarray | float, amplitude: float = DEFAULT_DAY_AMPLITUDE) -> np.ndarray:
    """Relative arrival rate at day fraction x in [0, 1): 1 - A cos(2 pi x); mean 1 over a day.

    Trough (1 - A) at x = 0 (midnight), peak (1 + A) at x = 0.5 (noon); with the default A = 0.5
    the peak is 3x the trough and 1.5x the daily mean.
    """
    return np.asarray(1.0 - amplitude * np.cos(2.0 * np.pi * np.asarray(x, dtype=float)))


def _tile_period(span_s: float, n: int) -> float:
    """A trace's tile period: its span plus one mean gap, so copies laid end to end (or an arrival
    wrapped round) neither overlap nor leave a hole; 1 s for a trace of one instant."""
    return span_s + (span_s / (n - 1) if n > 1 and span_s > 0 else 1.0)


def rotated(trace: Trace, offset_s: float) -> Trace:
    """`trace` with every arrival moved `offset_s` later, the arrivals pushed past its end wrapped
    round to its start (the tile period of `reshape`: the span plus one mean gap), the first at 0:
    the same requests and rate, meeting the control cycles and scrapes at another phase.

    >>> t = Trace("x", TraceFormat.AZURE, tuple(TraceRequest(s, 10, 5) for s in (0.0, 0.1, 0.2, 3.0)))
    >>> [round(r.t_s, 2) for r in rotated(t, 1.5).requests]  # the period is 4 s: 3.0 wraps to 0.5
    [0.0, 1.0, 1.1, 1.2]
    """
    reqs = trace.requests
    if len(reqs) < 2 or offset_s == 0:
        return trace
    period = _tile_period(reqs[-1].t_s, len(reqs))
    moved = sorted(((r.t_s + offset_s) % period, i) for i, r in enumerate(reqs))
    first = moved[0][0]
    return replace(trace, requests=tuple(replace(reqs[i], t_s=t - first) for t, i in moved))


def reshape(
    trace: Trace, *, duration_s: float, rate_scale: float = 1.0, amplitude: float = 0.0
) -> Trace:
    """Tile and time-warp `trace` onto [0, duration_s) (see shape_day); amplitude 0 = flat."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    if not 0.0 <= amplitude < 1.0:
        raise ValueError(f"amplitude must be in [0, 1), got {amplitude}")
    reqs = trace.requests
    n = len(reqs)
    if n == 0:
        return trace
    src_t = np.array([r.t_s for r in reqs], dtype=float)
    period = _tile_period(float(src_t[-1]), n)
    total_src = rate_scale * duration_s  # source seconds consumed over the new duration
    copies = math.ceil(total_src / period)
    tiled = (np.arange(copies)[:, None] * period + src_t[None, :]).ravel()
    idx = np.tile(np.arange(n), copies)
    keep = tiled < total_src
    tiled, idx = tiled[keep], idx[keep]
    # warp: source time tau(t) = rate_scale * integral_0^t f(u/duration) du, f = day_shape
    # tau(t) = rate_scale * (t - A * D / (2 pi) * sin(2 pi t / D)); strictly increasing for A < 1
    grid = np.linspace(0.0, duration_s, max(2049, min(200_001, int(duration_s) * 4 + 1)))
    tau = rate_scale * (grid - amplitude * duration_s / (2 * math.pi) * np.sin(2 * math.pi * grid / duration_s))
    new_t = np.interp(tiled, tau, grid)
    copy = (np.arange(copies)[:, None] + np.zeros((1, n), dtype=int)).ravel()[keep]
    tile_blocks = _tile_blocks(reqs)
    with _no_gc():
        out = tuple(
            TraceRequest(t, reqs[i].prompt_tokens, reqs[i].output_tokens, reqs[i].model, tile_blocks(i, k))
            for t, i, k in zip(new_t.tolist(), idx.tolist(), copy.tolist(), strict=True)
        )  # positional: keyword arguments cost a third more per request
    return replace(trace, requests=out)


SHARED_BLOCK_SHARE = 0.01  # a block in more than 1% of the requests is a shared prefix (a system prompt)


def shared_blocks(reqs: Sequence[TraceRequest]) -> frozenset[int]:
    """The blocks in more than SHARED_BLOCK_SHARE of the requests: shared prefixes (system prompts),
    which every copy of a tiled or resampled trace keeps; every other block belongs to one conversation."""
    counts: dict[int, int] = {}
    for r in reqs:
        for h in set(r.blocks or ()):
            counts[h] = counts.get(h, 0) + 1
    return frozenset(h for h, c in counts.items() if c > SHARED_BLOCK_SHARE * len(reqs))


def _tile_blocks(reqs: Sequence[TraceRequest]) -> Callable[[int, int], tuple[int, ...] | None]:
    """Block ids of request i in tile copy k: copy 0 keeps the trace's ids; a later copy is new
    conversations with the same shape, so its ids are offset by k x (largest id + 1), except the
    blocks shared by more than SHARED_BLOCK_SHARE of the requests (system prompts), which every
    copy shares. Without it a tiled trace would hit its own earlier copy."""
    ids = [h for r in reqs if r.blocks is not None for h in r.blocks]
    if not ids:
        return lambda i, k: reqs[i].blocks
    span = max(ids) + 1
    shared = shared_blocks(reqs)

    def blocks(i: int, k: int) -> tuple[int, ...] | None:
        b = reqs[i].blocks
        if b is None or k == 0:
            return b
        return tuple(h if h in shared else h + k * span for h in b)

    return blocks


def shape_day(
    trace: Trace, day_s: float, rate_scale: float = 1.0, *, amplitude: float = DEFAULT_DAY_AMPLITUDE
) -> Trace:
    """Stretch/tile a (~1 h) trace into a day shape of `day_s` seconds, keeping request lengths.

    Exactly:
    1. Tiling: the trace is repeated back to back on a source timeline, copy k shifted by
       k x P where P = the trace's span + one mean inter-arrival gap. Request k*n + i of the
       tiled timeline is request i of the trace, with its prompt and output lengths unchanged.
    2. Time warp: new time t maps to source time
       tau(t) = rate_scale x integral_0^t f(u / day_s) du,  f(x) = 1 - A cos(2 pi x)  (mean 1),
       and a source request at tau_i arrives at t_i = tau^-1(tau_i). Requests with
       tau_i >= tau(day_s) = rate_scale x day_s are dropped.
    Hence the arrival rate at new time t is rate_scale x f(t/day_s) x (the trace's own rate at
    tau(t)): the trace's burstiness and length mix are kept, the day's envelope is imposed, and
    the day holds about rate_scale x day_s / P x n requests. day_s may be shorter than the trace
    (a compressed day); rate_scale alone (amplitude 0, see reshape) only tiles and speeds up.
    """
    return reshape(trace, duration_s=day_s, rate_scale=rate_scale, amplitude=amplitude)


def repeat_days(day: Trace, days: int, day_s: float, *, end_s: float | None = None) -> Trace:
    """`days` copies of `day` back to back, copy k shifted by k x `day_s` (lengths, models and block
    ids kept), cut before `end_s` (None: every copy whole). The times are added in one numpy pass
    and each request is built once, after the cut (a week of a 1M-request day is 7M of them).

    >>> d = Trace("d", TraceFormat.AZURE, (TraceRequest(0.0, 5, 2), TraceRequest(30.0, 7, 3)))
    >>> [(r.t_s, r.prompt_tokens) for r in repeat_days(d, 3, 60.0, end_s=130.0).requests]
    [(0.0, 5), (30.0, 7), (60.0, 5), (90.0, 7), (120.0, 5)]
    """
    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    reqs = day.requests
    t = np.array([r.t_s for r in reqs], dtype=float)
    if np.any(np.diff(t) < 0) or (len(t) and t[-1] >= day_s):
        raise ValueError(f"{day.source}: the day's requests must be sorted and before day_s = {day_s}")
    cols = ([r.prompt_tokens for r in reqs], [r.output_tokens for r in reqs], [r.model for r in reqs],
            [r.blocks for r in reqs])
    out: list[TraceRequest] = []
    with _no_gc():
        for k in range(days):
            tk = t + k * day_s  # the same float as each request's t_s + k * day_s
            m = len(tk) if end_s is None else int(np.searchsorted(tk, end_s, side="left"))  # sorted: t < end_s
            out.extend(map(TraceRequest, tk[:m].tolist(), *(c[:m] for c in cols)))
            if m < len(tk):
                break
        return replace(day, requests=tuple(out))


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """The cyclic garbage collector paused while millions of requests are built (they hold no cycles;
    each collection on the way would walk every one built so far: half of a week's build time)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def iter_rates(requests: Iterable[TraceRequest], window_s: float, duration_s: float) -> np.ndarray:
    """Arrivals per second in consecutive windows of `window_s` over [0, duration_s)."""
    nwin = max(1, math.ceil(duration_s / window_s))
    counts = np.zeros(nwin)
    for r in requests:
        k = int(r.t_s // window_s)
        if 0 <= k < nwin:
            counts[k] += 1
    return counts / window_s


def window_rates(requests: Iterable[TraceRequest], window_s: float, duration_s: float) -> np.ndarray:
    """`iter_rates`, the last, partial window at its own rate (its arrivals over its own span).

    >>> from fleetplan.sim.traces import TraceRequest
    >>> reqs = [TraceRequest(t_s=t, prompt_tokens=1, output_tokens=1) for t in (1.0, 2.0, 11.0)]
    >>> window_rates(reqs, 10.0, 15.0).tolist()
    [0.2, 0.2]
    """
    rates = iter_rates(requests, window_s, duration_s)
    last_span = duration_s - (len(rates) - 1) * window_s
    if len(rates) and 0 < last_span < window_s:
        rates[-1] *= window_s / last_span
    return rates
