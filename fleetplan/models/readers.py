"""Benchmark file readers: text + file name in, typed BenchmarkPoints out (pure: no I/O here).

Formats (detected from the content, not the file name):
- `vllm bench serve --save-result` JSON: `mean_ttft_ms`, `median_itl_ms`, `p99_tpot_ms`, ... ;
- the InferenceX variant of it: the same keys without `_ms`, times in SECONDS (`median_ttft`, ...);
- `trtllm-bench throughput --report_json`: `engine`, `world_info`, `request_info`, `performance`,
  `streaming_metrics` sections;
- NVIDIA AIPerf `profile_export_aiperf.json` (and genai-perf's `profile_export_genai_perf.json`, the
  same layout): one object per metric with `unit`, `avg`, `p50`, `p99`;
- genai-perf / AIPerf CSV export: a `Metric,avg,min,max,p99,...` section and a `Metric,Value` section;
- the CSV tables of ../shared/data/benchmarks: TensorRT-LLM online serving (qps sweep), TensorRT-LLM
  perf-overview max throughput, and the seed articles table.

Metadata a file lacks (engine, GPU, TP, precision) comes from the file name when it says so
unambiguously (`glm5_fp8_vllm_tp8_isl6144_osl128_conc8.json`), else from `Metadata` (the CLI flags),
else the file is rejected with one line naming the file and the field. The model name comes from the
file, else the --model flag, else the file name (the words before the first metadata token).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fleetplan.models.bench import (
    BenchmarkFormatError,
    BenchmarkPoint,
    LoadKind,
    Metadata,
    check_value,
    require_value,
    show_value,
)
from fleetplan.models.names import (
    MAX_TP,
    Engine,
    GpuType,
    ModelAliases,
    Precision,
    UnknownNameError,
    model_name_problem,
    parse_engine,
    parse_gpu,
    parse_precision,
)

__all__ = ["BenchmarkFormatError", "FileHints", "ReadResult", "file_hints", "read_benchmark"]


@dataclass(frozen=True)
class ReadResult:
    points: tuple[BenchmarkPoint, ...]
    problems: tuple[str, ...] = ()  # rows skipped, each one line naming file, field and value
    format: str = ""


# ---------------------------------------------------------------------------------------------
# File-name hints


@dataclass(frozen=True)
class FileHints:
    model: str | None = None
    engine: Engine | None = None
    gpu: GpuType | None = None
    tp: int | None = None
    variant: str = ""
    precision: Precision | None = None
    isl: float | None = None
    osl: float | None = None
    concurrency: float | None = None
    rate_rps: float | None = None  # math.inf for "infqps"
    ambiguous: tuple[str, ...] = field(default_factory=tuple)


_TP_RE = re.compile(r"^(tp|tep|dep|etp)(\d{1,6})$")  # a longer run of digits is no TP (int() refuses > 4,300)
_ISL_RE = re.compile(r"^(?:isl|in)(\d+)$")
_OSL_RE = re.compile(r"^(?:osl|out)(\d+)$")
_CONC_RE = re.compile(r"^(?:conc|concurrency)(\d+)$")
_QPS_RE = re.compile(r"^(\d+(?:p\d+)?|inf)(?:qps|rps)$")


def _split_name(path: str) -> tuple[str, str]:
    parts = re.split(r"[\\/]", path)
    base = parts[-1]
    parent = parts[-2] if len(parts) > 1 else ""
    base = re.sub(r"\.(json|csv|jsonl|txt)$", "", base, flags=re.IGNORECASE)
    return base, parent


def _hints_of(name: str) -> dict[str, set[Any]]:
    found: dict[str, set[Any]] = {}
    lower = name.lower()

    def add(kind: str, value: Any) -> None:
        found.setdefault(kind, set()).add(value)

    if "tensorrt-llm" in lower or "trt-llm" in lower or "tensorrt_llm" in lower:
        add("engine", Engine.TRTLLM)
    tokens = [t for t in re.split(r"[_\-\s.]+", lower) if t]
    model_tokens: list[str] = []
    model_done = False
    for tok in tokens:
        meta = True
        if tok in ("vllm", "trtllm", "tensorrtllm"):
            add("engine", parse_engine(tok))
        elif m := _TP_RE.match(tok):
            n = int(m.group(2))
            add("tp", n)
            add("variant", f"dep{n}" if m.group(1) == "dep" else "")
        elif m := _ISL_RE.match(tok):
            add("isl", float(m.group(1)))
        elif m := _OSL_RE.match(tok):
            add("osl", float(m.group(1)))
        elif m := _CONC_RE.match(tok):
            add("concurrency", float(m.group(1)))
        elif m := _QPS_RE.match(tok):
            add("rate", math.inf if m.group(1) == "inf" else float(m.group(1).replace("p", ".")))
        elif tok in ("fp8", "bf16", "fp16", "fp4", "nvfp4", "int8", "int4", "w8a8", "w4a16", "awq"):
            add("precision", parse_precision(tok))
        elif re.match(r"^(gb200|gh200|b200|h200|h100|a100|l40s|rtx4090)", tok):
            add("gpu", parse_gpu(tok))
        else:
            meta = False
        if meta:
            model_done = True
        elif not model_done:
            model_tokens.append(tok)
    if model_tokens and model_done:
        add("model", "-".join(model_tokens))
    return found


def file_hints(path: str) -> FileHints:
    """What the file name (and its directory name) say, when they say it unambiguously."""
    base, parent = _split_name(path)
    own = _hints_of(base)
    up = _hints_of(parent) if parent else {}
    merged: dict[str, Any] = {}
    ambiguous: list[str] = []
    for kind in ("model", "engine", "gpu", "tp", "variant", "precision", "isl", "osl", "concurrency", "rate"):
        values = own.get(kind) or (up.get(kind) if kind not in ("model", "isl", "osl") else None)
        if not values:
            continue
        if len(values) > 1:
            ambiguous.append(kind)
            continue
        merged[kind] = next(iter(values))
    return FileHints(
        model=merged.get("model"), engine=merged.get("engine"), gpu=merged.get("gpu"),
        tp=merged.get("tp"), variant=merged.get("variant", ""), precision=merged.get("precision"),
        isl=merged.get("isl"), osl=merged.get("osl"), concurrency=merged.get("concurrency"),
        rate_rps=merged.get("rate"), ambiguous=tuple(ambiguous),
    )


# ---------------------------------------------------------------------------------------------
# Resolving metadata: the file's own value, else the CLI flag, else the file name


@dataclass(frozen=True)
class _Ctx:
    source: str
    meta: Metadata
    hints: FileHints
    aliases: ModelAliases

    def _missing(self, name: str, flag: str) -> BenchmarkFormatError:
        why = " (the file name is ambiguous)" if name in self.hints.ambiguous else ""
        return BenchmarkFormatError(
            f"{self.source}: field {name!r} is missing{why}; give it with --{flag}")

    def model(self, raw: object) -> str:
        if raw is not None and not isinstance(raw, str):
            raise BenchmarkFormatError(f"{self.source}: field 'model' must be a name, got {show_value(raw)}")
        name: str | None
        if raw:
            name, where = raw.strip(), ""
        elif self.meta.model:
            name, where = self.meta.model, " (--model)"
        else:
            name, where = self.hints.model, " (from the file name)"
        if not name:
            raise self._missing("model", "model")
        canonical = self.aliases.canonical(name)
        if canonical == name and "/" in name:
            canonical = self.aliases.canonical(name.split("/")[-1])
        for value in dict.fromkeys((name, canonical)):  # the name as read, then what an alias makes of it
            problem = model_name_problem(value)
            if problem is not None:  # a 100 kB name, a newline or NUL in it: not a name for paths, labels, logs
                raise BenchmarkFormatError(f"{self.source}: field 'model'{where} {problem}: {show_value(value)}")
        return canonical

    def _name_error(self, name: str, raw: object, exc: UnknownNameError | None = None) -> BenchmarkFormatError:
        """`field 'gpu': unknown GPU 'x'; known ...` with the value clipped (a 100 kB string stays short)."""
        if exc is None or not isinstance(raw, str):
            return BenchmarkFormatError(f"{self.source}: field {name!r} must be a name, got {show_value(raw)}")
        return BenchmarkFormatError(f"{self.source}: field {name!r}: {str(exc).replace(repr(raw), show_value(raw))}")

    def engine(self, raw: object) -> Engine:
        if isinstance(raw, str) and raw:  # anything else (a number, a list) names no engine
            try:
                return parse_engine(raw)
            except UnknownNameError:
                pass  # e.g. vllm bench serve's backend "openai": not an engine name
        engine = self.hints.engine or self.meta.engine
        if engine is None:
            raise self._missing("engine", "engine")
        return engine

    def gpu(self, raw: object) -> GpuType:
        if raw not in (None, ""):
            if not isinstance(raw, str):
                raise self._name_error("gpu", raw)
            try:
                return parse_gpu(raw)
            except UnknownNameError as exc:
                raise self._name_error("gpu", raw, exc) from None
        gpu = self.hints.gpu or self.meta.gpu
        if gpu is None:
            raise self._missing("gpu", "gpu")
        return gpu

    def _tp_range(self, raw: object, where: str = "") -> BenchmarkFormatError:
        return BenchmarkFormatError(f"{self.source}: field 'tp'{where} must be 1..{MAX_TP} (the TP sizes "
                                    f"fleetplan accepts), got {show_value(raw)}")

    def tp(self, raw: object) -> int:
        """The TP size, 1..MAX_TP whatever says it (`"tp": 1e300` is not a 301-digit TP size)."""
        if raw not in (None, ""):
            value = require_value(self.source, "tp", raw, positive=True)
            if value > MAX_TP:
                raise self._tp_range(raw)
            if value != int(value):
                raise BenchmarkFormatError(f"{self.source}: field 'tp' must be an integer, got {show_value(raw)}")
            return int(value)
        tp: int | None
        if self.hints.tp:
            tp, where = self.hints.tp, " (from the file name)"
        else:
            tp, where = self.meta.tp, " (--tp)"
        if tp is None:
            raise self._missing("tp", "tp")
        if not 1 <= tp <= MAX_TP:
            raise self._tp_range(tp, where)
        return tp

    def precision(self, raw: object) -> Precision:
        if raw not in (None, ""):
            if not isinstance(raw, str):
                raise self._name_error("precision", raw)
            try:
                return parse_precision(raw)
            except UnknownNameError as exc:
                raise self._name_error("precision", raw, exc) from None
        precision = self.hints.precision or self.meta.precision
        if precision is None:
            raise self._missing("precision", "precision")
        return precision


def _series(model: str, engine: Engine, gpu: GpuType, tp: int, precision: Precision, isl: float,
            osl: float) -> str:
    return f"{model}/{engine.value}/{gpu.value}/tp{tp}/{precision.value}/isl{isl:g}/osl{osl:g}"


# ---------------------------------------------------------------------------------------------
# JSON formats


def _num(d: Mapping[str, Any], key: str, source: str, scale: float = 1.0) -> float | None:
    return check_value(source, key, d.get(key), scale=scale)


def _first(d: Mapping[str, Any], keys: Sequence[str], source: str, scale: float = 1.0) -> float | None:
    for k in keys:
        if d.get(k) is not None:
            return check_value(source, k, d[k], scale=scale)
    return None


def _derived(source: str, expr: str, value: float, *, positive: bool = False) -> float:
    """A number computed from the file's fields (`expr` names them with their values): finite and
    non-negative (positive), else the error names the fields, their values and the result.

    >>> _derived("f.json", "field 'total_input_tokens' / field 'completed' (1e+300 / 1e-300)", 1e300 / 1e-300)
    Traceback (most recent call last):
    ...
    fleetplan.models.bench.BenchmarkFormatError: f.json: field 'total_input_tokens' / field 'completed' (1e+300 / 1e-300) = inf: out of range (must be finite and non-negative)
    """
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        kind = "positive" if positive else "non-negative"
        raise BenchmarkFormatError(f"{source}: {expr} = {value!r}: out of range (must be finite and {kind})")
    return value


def _rate_of(value: object, source: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in ("inf", "infinity"):
        return math.inf
    return check_value(source, "request_rate", value, positive=True)


def _read_vllm_serve(d: Mapping[str, Any], ctx: _Ctx, *, seconds: bool) -> ReadResult:
    src = ctx.source
    scale = 1000.0 if seconds else 1.0
    suffix = "" if seconds else "_ms"
    completed = require_value(src, "completed", d.get("completed"), positive=True)
    # tokens per request: 1e300 tokens / 1e-300 requests overflows, 5e-324 / 10 underflows to 0
    tokens_in = require_value(src, "total_input_tokens", d.get("total_input_tokens"), positive=True)
    tokens_out = require_value(src, "total_output_tokens", d.get("total_output_tokens"), positive=True)
    isl = _derived(src, f"field 'total_input_tokens' / field 'completed' ({tokens_in:g} / {completed:g})",
                   tokens_in / completed, positive=True)
    osl = _derived(src, f"field 'total_output_tokens' / field 'completed' ({tokens_out:g} / {completed:g})",
                   tokens_out / completed, positive=True)
    model = ctx.model(d.get("model_id"))
    engine = ctx.engine(d.get("backend"))
    gpu = ctx.gpu(None)
    tp = ctx.tp(d.get("tensor_parallel_size"))
    precision = ctx.precision(None)
    rate = _rate_of(d.get("request_rate"), src)
    conc = check_value(src, "max_concurrency", d.get("max_concurrency"), positive=True)
    if conc is not None:
        # never more in flight than the run sent: `--max-concurrency 32 --num-prompts 16` ran 16 at
        # once (the demo's own sweep did: a fit that took it for 32 saw the throughput stop rising at
        # 16 and put the knee at half the engine's real capacity)
        sent = check_value(src, "num_prompts", d.get("num_prompts"), positive=True)
        conc = min(conc, sent if sent is not None else completed)
    if rate is not None and math.isfinite(rate):
        load = LoadKind.RATE
    elif conc is not None:
        load = LoadKind.CONCURRENCY
    else:
        load = LoadKind.MAX

    def metric(stat: str, name: str) -> float | None:
        keys = [f"{stat}_{name}{suffix}"]
        if stat == "median":
            keys.append(f"p50_{name}{suffix}")
        return _first(d, keys, src, scale)

    point = BenchmarkPoint(
        source=src, model=model, engine=engine, gpu=gpu, tp=tp, precision=precision,
        isl=isl, osl=osl, load=load,
        rate_rps=rate if load is LoadKind.RATE else None,
        concurrency=conc if load is LoadKind.CONCURRENCY else None,
        request_rps=require_value(src, "request_throughput", d.get("request_throughput")),
        output_tok_s=require_value(src, "output_throughput", d.get("output_throughput")),
        ttft_mean_ms=metric("mean", "ttft"), ttft_p50_ms=metric("median", "ttft"),
        ttft_p99_ms=metric("p99", "ttft"),
        itl_mean_ms=metric("mean", "itl"), itl_p50_ms=metric("median", "itl"), itl_p99_ms=metric("p99", "itl"),
        tpot_mean_ms=metric("mean", "tpot"), tpot_p50_ms=metric("median", "tpot"),
        tpot_p99_ms=metric("p99", "tpot"),
        variant=ctx.hints.variant,
    )
    if point.ttft_mean_ms is None and point.ttft_p50_ms is None and point.ttft_p99_ms is None:
        raise BenchmarkFormatError(f"{src}: field 'mean_ttft{suffix}' is missing (no TTFT statistic at all)")
    point = _with_series(point)
    return ReadResult((point,), format="vllm-inferencex" if seconds else "vllm-bench-serve")


def _with_series(p: BenchmarkPoint) -> BenchmarkPoint:
    series = _series(p.model + (f"+{p.variant}" if p.variant else ""), p.engine, p.gpu, p.tp,
                     p.precision, round(p.isl), round(p.osl))
    return replace(p, series=series)


def _section(d: Mapping[str, Any], name: str, src: str) -> Mapping[str, Any]:
    value = d.get(name)
    if not isinstance(value, Mapping):
        raise BenchmarkFormatError(f"{src}: field {name!r} is missing or not an object")
    return value


def _read_trtllm_bench(d: Mapping[str, Any], ctx: _Ctx) -> ReadResult:
    src = ctx.source
    eng = _section(d, "engine", src)
    perf = _section(d, "performance", src)
    req = _section(d, "request_info", src)
    world = d.get("world_info") if isinstance(d.get("world_info"), Mapping) else {}
    assert isinstance(world, Mapping)
    machine = d.get("machine") if isinstance(d.get("machine"), Mapping) else {}
    assert isinstance(machine, Mapping)
    quant = eng.get("quantization")
    if quant is None or (isinstance(quant, str) and quant.strip().lower() in ("", "none", "no_quant")):
        quant = eng.get("dtype")
    output = _first(perf, ("system_output_throughput_tok_s", "output_throughput_tok_s"), src)
    if output is None:
        raise BenchmarkFormatError(f"{src}: field 'performance.system_output_throughput_tok_s' is missing")
    stream = d.get("streaming_metrics") if isinstance(d.get("streaming_metrics"), Mapping) else None
    ttft: dict[str, float | None] = {}
    tpot: dict[str, float | None] = {}
    if stream is not None:
        ttft_p = stream.get("ttft_percentiles")
        tpot_p = stream.get("tpot_percentiles")
        ttft_p = ttft_p if isinstance(ttft_p, Mapping) else {}
        tpot_p = tpot_p if isinstance(tpot_p, Mapping) else {}
        ttft = {"mean": _first(stream, ("avg_ttft_ms",), src) or _num(ttft_p, "average", src),
                "p50": _num(ttft_p, "p50", src), "p99": _num(ttft_p, "p99", src)}
        tpot = {"mean": _first(stream, ("avg_tpot_ms",), src) or _num(tpot_p, "average", src),
                "p50": _num(tpot_p, "p50", src), "p99": _num(tpot_p, "p99", src)}
    conc = ctx.hints.concurrency
    point = BenchmarkPoint(
        source=src, model=ctx.model(eng.get("model")), engine=ctx.engine("tensorrt-llm"),
        gpu=ctx.gpu(machine.get("name")), tp=ctx.tp(world.get("tp_size")), precision=ctx.precision(quant),
        isl=require_value(src, "request_info.avg_input_length", req.get("avg_input_length"), positive=True),
        osl=require_value(src, "request_info.avg_output_length", req.get("avg_output_length"), positive=True),
        load=LoadKind.CONCURRENCY if conc is not None else LoadKind.MAX, concurrency=conc,
        request_rps=_num(perf, "request_throughput_req_s", src), output_tok_s=output,
        ttft_mean_ms=ttft.get("mean"), ttft_p50_ms=ttft.get("p50"), ttft_p99_ms=ttft.get("p99"),
        tpot_mean_ms=tpot.get("mean"), tpot_p50_ms=tpot.get("p50"), tpot_p99_ms=tpot.get("p99"),
        variant=ctx.hints.variant,
    )
    return ReadResult((_with_series(point),), format="trtllm-bench")


_TIME_UNITS = {"ms": 1.0, "s": 1000.0, "sec": 1000.0, "seconds": 1000.0, "us": 1e-3, "ns": 1e-6}


def _aiperf_metric(metrics: Mapping[str, Any], name: str, src: str) -> dict[str, float | None]:
    m = metrics.get(name)
    if m is None:
        return {}
    if not isinstance(m, Mapping):
        raise BenchmarkFormatError(f"{src}: field {name!r} must be an object, got {show_value(m)}")
    unit_raw = m.get("unit", "ms")
    unit = unit_raw.strip().lower() if isinstance(unit_raw, str) else unit_raw
    scale = 1.0
    if name in ("time_to_first_token", "inter_token_latency", "request_latency"):
        if not isinstance(unit, str) or unit not in _TIME_UNITS:
            raise BenchmarkFormatError(f"{src}: field '{name}.unit' is not a time unit: {show_value(unit_raw)}")
        scale = _TIME_UNITS[unit]
    return {
        "mean": check_value(src, f"{name}.avg", m.get("avg"), scale=scale),
        "p50": check_value(src, f"{name}.p50", m.get("p50"), scale=scale),
        "p99": check_value(src, f"{name}.p99", m.get("p99"), scale=scale),
    }


def _aiperf_model(cfg: Mapping[str, Any], endpoint: Mapping[str, Any]) -> str | None:
    """The model name: AIPerf endpoint.model_names[0], newer AIPerf models.items[0].name, genai-perf
    input_config.model (a name or a list of names)."""
    names = endpoint.get("model_names")
    if isinstance(names, list) and names and isinstance(names[0], str):
        return names[0]
    models = cfg.get("models")
    items = models.get("items") if isinstance(models, Mapping) else None
    if isinstance(items, list) and items and isinstance(items[0], Mapping) and isinstance(items[0].get("name"), str):
        return str(items[0]["name"])
    model = cfg.get("model")
    if isinstance(model, list) and model and isinstance(model[0], str):
        return model[0]
    return model if isinstance(model, str) else None


def _read_aiperf(d: Mapping[str, Any], ctx: _Ctx) -> ReadResult:
    src = ctx.source
    metrics: Mapping[str, Any] = d["records"] if isinstance(d.get("records"), Mapping) else d
    cfg = d.get("input_config") if isinstance(d.get("input_config"), Mapping) else {}
    assert isinstance(cfg, Mapping)
    endpoint = cfg.get("endpoint") if isinstance(cfg.get("endpoint"), Mapping) else {}
    loadgen = cfg.get("loadgen") if isinstance(cfg.get("loadgen"), Mapping) else {}
    assert isinstance(endpoint, Mapping) and isinstance(loadgen, Mapping)
    model_raw = _aiperf_model(cfg, endpoint)
    gpu_raw = None
    telemetry = d.get("telemetry_data")
    endpoints = telemetry.get("endpoints") if isinstance(telemetry, Mapping) else None
    for ep in endpoints.values() if isinstance(endpoints, Mapping) else ():
        gpus = ep.get("gpus") if isinstance(ep, Mapping) else None
        for g in gpus.values() if isinstance(gpus, Mapping) else ():
            if isinstance(g, Mapping) and isinstance(g.get("gpu_name"), str) and gpu_raw is None:
                gpu_raw = g["gpu_name"]
    ttft = _aiperf_metric(metrics, "time_to_first_token", src)
    itl = _aiperf_metric(metrics, "inter_token_latency", src)
    thr = _aiperf_metric(metrics, "request_throughput", src).get("mean")
    out = _aiperf_metric(metrics, "output_token_throughput", src).get("mean")
    if out is None:
        raise BenchmarkFormatError(f"{src}: field 'output_token_throughput' is missing")
    if not ttft:
        raise BenchmarkFormatError(f"{src}: field 'time_to_first_token' is missing")
    isl = _aiperf_metric(metrics, "input_sequence_length", src).get("mean")
    osl = _aiperf_metric(metrics, "output_sequence_length", src).get("mean")
    isl = isl if isl is not None else ctx.hints.isl
    osl = osl if osl is not None else ctx.hints.osl
    if isl is None or isl <= 0:
        raise BenchmarkFormatError(f"{src}: field 'input_sequence_length' is missing or zero: {show_value(isl)}")
    if osl is None or osl <= 0:
        raise BenchmarkFormatError(f"{src}: field 'output_sequence_length' is missing or zero: {show_value(osl)}")
    # AIPerf: input_config.loadgen.{concurrency,request_rate}; genai-perf: input_config.{concurrency,...}
    where = "input_config.loadgen" if "loadgen" in cfg else "input_config"
    knobs = loadgen if "loadgen" in cfg else cfg
    conc = check_value(src, f"{where}.concurrency", knobs.get("concurrency"), positive=True)
    rate = check_value(src, f"{where}.request_rate", knobs.get("request_rate"), positive=True)
    conc = conc if conc is not None else ctx.hints.concurrency
    if rate is not None:
        load = LoadKind.RATE
    elif conc is not None:
        load = LoadKind.CONCURRENCY
    else:
        raise BenchmarkFormatError(f"{src}: field 'input_config.loadgen.concurrency' is missing "
                                   "(neither a concurrency nor a request rate is recorded)")
    point = BenchmarkPoint(
        source=src, model=ctx.model(model_raw), engine=ctx.engine(None), gpu=ctx.gpu(gpu_raw), tp=ctx.tp(None),
        precision=ctx.precision(None), isl=isl, osl=osl, load=load,
        rate_rps=rate if load is LoadKind.RATE else None,
        concurrency=conc if load is LoadKind.CONCURRENCY else None,
        request_rps=thr, output_tok_s=out,
        ttft_mean_ms=ttft.get("mean"), ttft_p50_ms=ttft.get("p50"), ttft_p99_ms=ttft.get("p99"),
        itl_mean_ms=itl.get("mean"), itl_p50_ms=itl.get("p50"), itl_p99_ms=itl.get("p99"),
        variant=ctx.hints.variant,
    )
    return ReadResult((_with_series(point),), format="aiperf")


def _detect_json(d: Any, src: str) -> Callable[[Mapping[str, Any], _Ctx], ReadResult]:
    if not isinstance(d, Mapping):
        raise BenchmarkFormatError(f"{src}: expected a JSON object at the top level, got {type(d).__name__}")
    if isinstance(d.get("performance"), Mapping) and ("request_info" in d or "engine" in d):
        return _read_trtllm_bench
    metrics = d["records"] if isinstance(d.get("records"), Mapping) else d
    if isinstance(metrics.get("time_to_first_token"), Mapping) or isinstance(
            metrics.get("request_throughput"), Mapping):
        return _read_aiperf
    if any(k.endswith("_ttft_ms") or k.endswith("_tpot_ms") for k in d):
        return lambda dd, ctx: _read_vllm_serve(dd, ctx, seconds=False)
    if any(k in d for k in ("median_ttft", "mean_ttft", "p99_ttft", "median_tpot")):
        return lambda dd, ctx: _read_vllm_serve(dd, ctx, seconds=True)
    raise BenchmarkFormatError(
        f"{src}: unrecognised JSON benchmark format (keys: {', '.join(show_value(k) for k in sorted(d)[:8])}); "
        "expected vllm bench "
        "serve, InferenceX, trtllm-bench --report_json or AIPerf profile_export_aiperf.json")


# ---------------------------------------------------------------------------------------------
# CSV formats


def _rows(text: str) -> list[tuple[dict[str, str], int]]:
    """The data rows as {column: cell} (cells a short row lacks are ""), each with its number of
    non-empty cells beyond the header's columns (a row that does not fit the header)."""
    reader = csv.reader(io.StringIO(text))
    header = [c.strip() for c in next(reader, [])]
    out: list[tuple[dict[str, str], int]] = []
    for cells in reader:
        if not cells:
            continue  # a blank line, as csv.DictReader skips it
        row = {h: "" for h in header}
        row.update(zip(header, (c.strip() for c in cells), strict=False))
        out.append((row, len(cells) if any(c.strip() for c in cells[len(header):]) else 0))
    return out


def _table(text: str, ctx: _Ctx, build: Callable[[dict[str, str], _Ctx], BenchmarkPoint | None],
           fmt: str) -> ReadResult:
    points: list[BenchmarkPoint] = []
    problems: list[str] = []
    columns = len(next(csv.reader(io.StringIO(text)), []))
    for i, (row, too_many) in enumerate(_rows(text), start=2):  # line 1 is the header
        row_ctx = _Ctx(f"{ctx.source}:{i}", ctx.meta, ctx.hints, ctx.aliases)
        if too_many:  # its cells may be shifted: not read as if they were in their columns
            problems.append(f"{row_ctx.source}: row has {too_many} cells, the header {columns}")
            continue
        try:
            point = build(row, row_ctx)
        except BenchmarkFormatError as exc:
            problems.append(str(exc))
            continue
        if point is not None:
            points.append(_with_series(point))
    if not points:
        reason = problems[0] if problems else f"{ctx.source}: no data rows"
        raise BenchmarkFormatError(reason if len(problems) <= 1 else f"{reason} (and {len(problems) - 1} more rows)")
    return ReadResult(tuple(points), tuple(problems), fmt)


def _online_row(row: dict[str, str], ctx: _Ctx) -> BenchmarkPoint:
    src = ctx.source
    qps_raw = row.get("qps", "")
    rate = _rate_of(qps_raw or None, src)
    if rate is None:
        raise BenchmarkFormatError(f"{src}: field 'qps' is missing")
    load = LoadKind.MAX if math.isinf(rate) else LoadKind.RATE
    return BenchmarkPoint(
        source=src, model=ctx.model(row.get("model")), engine=ctx.engine(row.get("engine")),
        gpu=ctx.gpu(row.get("gpu")), tp=ctx.tp(row.get("tp")), precision=ctx.precision(row.get("precision")),
        isl=require_value(src, "isl", row.get("isl"), positive=True),
        osl=require_value(src, "osl", row.get("osl"), positive=True),
        load=load, rate_rps=rate if load is LoadKind.RATE else None,
        request_rps=check_value(src, "req_throughput_rps", row.get("req_throughput_rps")),
        output_tok_s=check_value(src, "output_tput_tok_s", row.get("output_tput_tok_s")),
        ttft_mean_ms=check_value(src, "mean_ttft_ms", row.get("mean_ttft_ms")),
        itl_mean_ms=check_value(src, "mean_itl_ms", row.get("mean_itl_ms")),
    )


def _throughput_row(column: str) -> Callable[[dict[str, str], _Ctx], BenchmarkPoint]:
    def build(row: dict[str, str], ctx: _Ctx) -> BenchmarkPoint:
        src = ctx.source
        return BenchmarkPoint(
            source=src, model=ctx.model(row.get("model")), engine=ctx.engine(row.get("engine")),
            gpu=ctx.gpu(row.get("gpu")), tp=ctx.tp(row.get("tp")), precision=ctx.precision(row.get("precision")),
            isl=require_value(src, "isl", row.get("isl"), positive=True),
            osl=require_value(src, "osl", row.get("osl"), positive=True),
            load=LoadKind.MAX, output_tok_s=require_value(src, column, row.get(column), positive=True),
        )
    return build


_WORKLOAD_ISL = re.compile(r"\bISL\s+(\d+(?:\.\d+)?)", re.IGNORECASE)
_WORKLOAD_OSL = re.compile(r"\bOSL\s+(\d+(?:\.\d+)?)", re.IGNORECASE)


def _seed_row(row: dict[str, str], ctx: _Ctx) -> BenchmarkPoint:
    """seed_articles.csv: figures quoted in articles; only rows with ISL, OSL and TP are usable.

    Rows whose workload is a 'static batch' quote per-request generation speed in throughput_tok_s
    (the RTX 4090 article): ITL = 1000 / speed and output tok/s = batch * speed.
    """
    src = ctx.source
    workload = row.get("workload", "")
    isl_m, osl_m = _WORKLOAD_ISL.search(workload), _WORKLOAD_OSL.search(workload)
    if isl_m is None or osl_m is None:
        raise BenchmarkFormatError(f"{src}: field 'workload' names no ISL and OSL: {show_value(workload)}")
    isl = require_value(src, "workload ISL", isl_m.group(1), positive=True)
    osl = require_value(src, "workload OSL", osl_m.group(1), positive=True)
    batch = check_value(src, "batch_or_concurrency", row.get("batch_or_concurrency"), positive=True)
    if batch is None:
        raise BenchmarkFormatError(f"{src}: field 'batch_or_concurrency' is missing")
    speed = check_value(src, "throughput_tok_s", row.get("throughput_tok_s"), positive=True)
    if speed is None:
        raise BenchmarkFormatError(f"{src}: field 'throughput_tok_s' is missing")
    per_request = "static batch" in workload.lower()
    return BenchmarkPoint(
        source=src, model=ctx.model(row.get("model")), engine=ctx.engine(row.get("engine")),
        gpu=ctx.gpu(row.get("gpu")), tp=ctx.tp(row.get("tp")), precision=ctx.precision(row.get("precision")),
        isl=isl, osl=osl, load=LoadKind.CONCURRENCY, concurrency=batch,
        # 1e200 tok/s x 1e200 requests overflows; 1000 / 5e-324 tok/s too
        output_tok_s=_derived(src, f"field 'throughput_tok_s' x field 'batch_or_concurrency' ({speed:g} x {batch:g})",
                              speed * batch) if per_request else speed,
        itl_mean_ms=_derived(src, f"1000 / field 'throughput_tok_s' (1000 / {speed:g})", 1000.0 / speed)
        if per_request else None,
    )


def _genai_perf_csv(text: str, ctx: _Ctx) -> ReadResult:
    """genai-perf `profile_export_genai_perf.csv` (and the AIPerf CSV export, same layout)."""
    src = ctx.source
    stats: dict[str, dict[str, str]] = {}
    header: list[str] | None = None
    for row in csv.reader(io.StringIO(text)):
        if not row or not any(c.strip() for c in row):
            header = None
            continue
        if row[0].strip().lower() == "metric":
            header = [c.strip().lower() for c in row]
            continue
        if header is None:
            continue
        name = re.sub(r"\s+", " ", row[0].strip().lower())
        stats[name] = {h: (row[i].strip() if i < len(row) else "") for i, h in enumerate(header)}

    def find(prefix: str) -> tuple[dict[str, str], float] | None:
        for name, values in stats.items():
            if name.startswith(prefix):
                unit = re.search(r"\((ms|ns|us|s|sec)\)", name)
                return values, _TIME_UNITS[unit.group(1)] if unit else 1.0
        return None

    def stat(prefix: str, col: str) -> float | None:
        found = find(prefix)
        if found is None:
            return None
        values, scale = found
        raw = values.get(col) if col in values else values.get("value")
        return check_value(src, f"{prefix} {col}", raw, scale=scale)

    if find("time to first token") is None:
        raise BenchmarkFormatError(f"{src}: field 'Time To First Token' is missing")
    out = stat("output token throughput", "avg")
    if out is None:
        raise BenchmarkFormatError(f"{src}: field 'Output Token Throughput (per sec)' is missing")
    isl = stat("input sequence length", "avg") or ctx.hints.isl
    osl = stat("output sequence length", "avg") or ctx.hints.osl
    if isl is None or osl is None:
        raise BenchmarkFormatError(f"{src}: field 'Input/Output Sequence Length' is missing")
    hints = ctx.hints
    if hints.rate_rps is not None and math.isfinite(hints.rate_rps):
        load, rate, conc = LoadKind.RATE, hints.rate_rps, None
    elif hints.concurrency is not None:
        load, rate, conc = LoadKind.CONCURRENCY, None, hints.concurrency
    else:
        raise BenchmarkFormatError(f"{src}: field 'concurrency' is missing: genai-perf CSV does not record "
                                   "the load; keep the artifacts directory name (…-concurrency8/)")
    point = BenchmarkPoint(
        source=src, model=ctx.model(None), engine=ctx.engine(None), gpu=ctx.gpu(None), tp=ctx.tp(None),
        precision=ctx.precision(None), isl=isl, osl=osl, load=load, rate_rps=rate, concurrency=conc,
        request_rps=stat("request throughput", "avg"), output_tok_s=out,
        ttft_mean_ms=stat("time to first token", "avg"), ttft_p50_ms=stat("time to first token", "p50"),
        ttft_p99_ms=stat("time to first token", "p99"),
        itl_mean_ms=stat("inter token latency", "avg"), itl_p50_ms=stat("inter token latency", "p50"),
        itl_p99_ms=stat("inter token latency", "p99"), variant=hints.variant,
    )
    return ReadResult((_with_series(point),), format="genai-perf-csv")


def _read_csv(text: str, ctx: _Ctx) -> ReadResult:
    text = text.lstrip("\ufeff")  # a BOM is not part of the first column's name
    first = text.splitlines()[0] if text.strip() else ""
    cols = {c.strip().lower() for c in first.split(",")}
    if first.lower().startswith("metric,"):
        return _genai_perf_csv(text, ctx)
    if {"qps", "mean_ttft_ms", "mean_itl_ms"} <= cols:
        return _table(text, ctx, _online_row, "trtllm-online-table")
    for column in ("token_throughput_tok_s_as_reported", "total_output_throughput_tok_s",
                   "output_throughput_tok_s"):
        if column in cols and {"isl", "osl"} <= cols:
            return _table(text, ctx, _throughput_row(column), "trtllm-throughput-table")
    if {"batch_or_concurrency", "throughput_tok_s", "workload"} <= cols:
        return _table(text, ctx, _seed_row, "seed-articles")
    raise BenchmarkFormatError(f"{ctx.source}: unrecognised CSV benchmark table (columns: {first[:120]!r})")


# ---------------------------------------------------------------------------------------------


def read_benchmark(text: str, filename: str, meta: Metadata | None = None,
                   aliases: ModelAliases | None = None) -> ReadResult:
    """Parse one benchmark file. Raises BenchmarkFormatError (one line: file, field, value)."""
    ctx = _Ctx(filename, meta or Metadata(), file_hints(filename), aliases or ModelAliases())
    stripped = text.strip()
    if not stripped:
        raise BenchmarkFormatError(f"{filename}: empty file")
    try:
        if stripped[0] in "{[":
            try:
                data = json.loads(stripped)
            except (ValueError, RecursionError) as exc:
                if isinstance(exc, json.JSONDecodeError):
                    where = f" at line {exc.lineno} column {exc.colno}: {exc.msg}"
                elif isinstance(exc, RecursionError):
                    where = ": nested too deeply"
                else:  # a number of more than 4,300 digits
                    where = f": {str(exc).split(';')[0]}"
                raise BenchmarkFormatError(f"{filename}: invalid JSON{where}") from None
            return _detect_json(data, filename)(data, ctx)
        return _read_csv(text, ctx)
    except (TypeError, AttributeError, KeyError, IndexError, ValueError, ArithmeticError, RecursionError,
            csv.Error) as exc:
        if isinstance(exc, BenchmarkFormatError):
            raise
        why = " ".join(str(exc).split())[:200]
        if isinstance(exc, csv.Error):  # e.g. a cell longer than the csv module's 131,072 characters
            raise BenchmarkFormatError(f"{filename}: unreadable CSV ({why})") from None
        # a shape no reader expects (a list where an object belongs, ...): still one line, no crash
        raise BenchmarkFormatError(f"{filename}: unexpected content ({type(exc).__name__}: {why})") from None
