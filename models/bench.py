"""One normalised benchmark measurement, whatever tool produced it."""

from __future__ import annotations

import math
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


def check_value(source: str, name: str, value: object, *, optional: bool = True,
                positive: bool = False, scale: float = 1.0) -> float | None:
    """A finite, non-negative number (times `scale`), None when absent and optional; else an error."""
    if value is None or (isinstance(value, str) and value.strip() in ("", "N/A", "n/a", "null", "None")):
        if optional:
            return None
        raise BenchmarkFormatError(f"{source}: field {name!r} is missing")
    if isinstance(value, bool):
        raise BenchmarkFormatError(f"{source}: field {name!r} must be a number, got {value!r}")
    if isinstance(value, str):
        try:
            number = float(value.replace(",", "").strip())
        except ValueError:
            raise BenchmarkFormatError(f"{source}: field {name!r} must be a number, got {value!r}") from None
    elif isinstance(value, int | float):
        number = float(value)
    else:
        raise BenchmarkFormatError(f"{source}: field {name!r} must be a number, got {value!r}")
    if math.isnan(number) or math.isinf(number):
        raise BenchmarkFormatError(f"{source}: field {name!r} must be finite, got {value!r}")
    if number < 0 or (positive and number == 0):
        kind = "positive" if positive else "non-negative"
        raise BenchmarkFormatError(f"{source}: field {name!r} must be {kind}, got {value!r}")
    return number * scale


def require_value(source: str, name: str, value: object, *, positive: bool = False,
                  scale: float = 1.0) -> float:
    out = check_value(source, name, value, optional=False, positive=positive, scale=scale)
    assert out is not None
    return out
