"""One normalised benchmark measurement, whatever tool produced it."""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass
from enum import StrEnum

from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.models.profile import ConfigKey


class LoadKind(StrEnum):
    RATE = "rate"  # open loop: requests arrive at rate_rps
    CONCURRENCY = "concurrency"  # closed loop: `concurrency` requests always in flight
    MAX = "max"  # offline / unbounded rate: only the saturation throughput is meaningful


class BenchmarkFormatError(ValueError):
    """A benchmark file or row that cannot be read; one line naming the file, field and value."""


@dataclass(frozen=True)
class Metadata:
    """What a file may lack and the CLI flags supply (None: not given)."""

    model: str | None = None
    engine: Engine | None = None
    gpu: GpuType | None = None
    tp: int | None = None
    precision: Precision | None = None


@dataclass(frozen=True)
class BenchmarkPoint:
    """One measured operating point. Times in ms, throughputs per second; None: not reported."""

    source: str  # file name (and row) it came from
    model: str
    engine: Engine
    gpu: GpuType
    tp: int
    precision: Precision
    isl: float  # mean prompt tokens
    osl: float  # mean output tokens
    load: LoadKind
    rate_rps: float | None = None  # offered rate (RATE)
    concurrency: float | None = None  # clients (CONCURRENCY)
    request_rps: float | None = None  # achieved
    output_tok_s: float | None = None
    ttft_mean_ms: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_mean_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    tpot_mean_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    variant: str = ""  # deployment variant that is not in the key (e.g. "dep8": data+expert parallel)
    series: str = ""  # the sweep this point belongs to (for leave-one-series-out evaluation)

    @property
    def key(self) -> ConfigKey:
        model = self.model if not self.variant else f"{self.model}+{self.variant}"
        return ConfigKey(model, self.engine, self.gpu, self.tp, self.precision)

    # ITL where reported, else TPOT (per-request mean time per output token) as its stand-in
    @property
    def itl_like_mean_ms(self) -> float | None:
        return self.itl_mean_ms if self.itl_mean_ms is not None else self.tpot_mean_ms

    @property
    def itl_like_p50_ms(self) -> float | None:
        return self.itl_p50_ms if self.itl_p50_ms is not None else self.tpot_p50_ms

    @property
    def itl_like_p99_ms(self) -> float | None:
        return self.itl_p99_ms if self.itl_p99_ms is not None else self.tpot_p99_ms


_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 60
_SHOW.maxlong = 40
_SHOW.maxlevel = 2
_SHOW.maxlist = _SHOW.maxtuple = _SHOW.maxdict = 4


def show_value(value: object) -> str:
    """A value as an error message quotes it: its repr, clipped (a 100 kB string, a 400-digit number
    or a 900-level list stays a short line).

    >>> show_value(float("nan")), show_value(-5.0), show_value("fast")
    ('nan', '-5.0', "'fast'")
    >>> show_value("x" * 100_000)
    "'xxxxxxxxxxxxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxxxxxxxxxxxx'"
    >>> show_value([[[[[1]]]]])
    '[[[...]]]'
    """
    try:
        return _SHOW.repr(value)
    except (ValueError, RecursionError):  # an int beyond Python's 4,300 digits for str()
        return f"<{type(value).__name__}>"


def check_value(source: str, name: str, value: object, *, optional: bool = True,
                positive: bool = False, scale: float = 1.0) -> float | None:
    """A finite, non-negative number (times `scale`), None when absent and optional; else an error.

    >>> check_value("f.json", "p99_ttft", "0.5", scale=1000.0)
    500.0
    >>> check_value("f.json", "p99_ttft", 1e308, scale=1000.0)
    Traceback (most recent call last):
    ...
    fleetplan.models.bench.BenchmarkFormatError: f.json: field 'p99_ttft' must be finite, got 1e+308 (x1000: out of range)
    >>> check_value("f.json", "completed", 10**400)
    Traceback (most recent call last):
    ...
    fleetplan.models.bench.BenchmarkFormatError: f.json: field 'completed' must be finite, got 100000000000000000...0000000000000000000
    """
    shown = show_value(value)
    if value is None or (isinstance(value, str) and value.strip() in ("", "N/A", "n/a", "null", "None")):
        if optional:
            return None
        raise BenchmarkFormatError(f"{source}: field {name!r} is missing")
    if isinstance(value, bool):
        raise BenchmarkFormatError(f"{source}: field {name!r} must be a number, got {shown}")
    if isinstance(value, str):
        try:
            number = float(value.replace(",", "").strip())
        except ValueError:
            raise BenchmarkFormatError(f"{source}: field {name!r} must be a number, got {shown}") from None
    elif isinstance(value, int | float):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond the float range (JSON allows 10**400)
            raise BenchmarkFormatError(f"{source}: field {name!r} must be finite, got {shown}") from None
    else:
        raise BenchmarkFormatError(f"{source}: field {name!r} must be a number, got {shown}")
    if math.isnan(number) or math.isinf(number):
        raise BenchmarkFormatError(f"{source}: field {name!r} must be finite, got {shown}")
    if number < 0 or (positive and number == 0):
        kind = "positive" if positive else "non-negative"
        raise BenchmarkFormatError(f"{source}: field {name!r} must be {kind}, got {shown}")
    scaled = number * scale
    if math.isinf(scaled):  # seconds to ms of 1e308
        raise BenchmarkFormatError(f"{source}: field {name!r} must be finite, got {shown} (x{scale:g}: out of range)")
    return scaled


def require_value(source: str, name: str, value: object, *, positive: bool = False,
                  scale: float = 1.0) -> float:
    out = check_value(source, name, value, optional=False, positive=positive, scale=scale)
    assert out is not None
    return out
