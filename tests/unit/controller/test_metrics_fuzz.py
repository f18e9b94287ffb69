"""Fuzzing the engines' /metrics text against the real parser the drain uses
(`inflight_from_metrics`: running + waiting requests of a vLLM or TensorRT-LLM replica).

Properties: whatever the text, the parser never raises and returns None ("unknown") or a finite
number >= 0; on generated expositions it returns exactly what an independent reading of the
generated samples says: the sum of the in-flight gauges' samples, None when they are not exported,
None when any of them is not a finite non-negative number (NaN, +Inf, -1, 1e999, a missing or
unparsable value) or the sum overflows. Inputs: expositions mixing the six gauge names (vllm:,
vllm_, trtllm_ x running, waiting) with random labels (quoted values holding `}`, `\\"`, `,`),
optional timestamps, comments, other metrics (`vllm:num_requests_waiting_by_reason`, histograms),
hostile values, lines of the gauges that do not parse, huge lines; random text and bytes.

When an engine's own /metrics is unreachable, `Executor.inflight` falls back to Prometheus'
`sum()` of the same gauges (`inflight_from_prometheus`): whatever values it answers, the count is
the one finite non-negative value or None (NaN, +Inf, -Inf, -1, no series, several samples); the
fallback is also run end to end through a PromClient and an engine URL on mock transports.

The example counts here keep this file to a few seconds; `bench/fuzz_wire.py --only metrics` runs
the same property with 10,000 examples.
"""

from __future__ import annotations

import doctest
import math
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fleetplan.controller import executor
from fleetplan.controller.executor import Executor, inflight_from_metrics, inflight_from_prometheus
from fleetplan.controller.observe import PromClient
from fleetplan.controller.settings import ControllerSettings
from fleetplan.planner import act
from fleetplan.planner.act import Phase, ReplicaRow

UNIT_EXAMPLES = 300  # bench/fuzz_wire.py: 10,000

ANY = object()  # no oracle (random text): only the general property holds
GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm_num_requests_running",
          "vllm_num_requests_waiting", "trtllm_num_requests_running", "trtllm_num_requests_waiting"]
OTHER = ["vllm:num_requests_waiting_by_reason", "vllm:num_requests_running_total", "vllm:gpu_cache_usage_perc",
         "vllm:time_to_first_token_seconds_bucket", "trtllm_num_requests_completed", "num_requests_running",
         "xvllm:num_requests_running", "vllm:num_requests", "process_cpu_seconds_total"]

LABEL_NAME = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,8}", fullmatch=True)
# label values: no line breaks of any kind (str.splitlines splits on \x1c, \x85, \u2028 too)
LABEL_VALUE = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=12) | st.sampled_from(
    ["}", "{", '"', "\\", "a,b", 'x"} 9', "} NaN", "=", " "])


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


@st.composite
def labels(draw: st.DrawFn) -> str:
    pairs = draw(st.lists(st.tuples(LABEL_NAME, LABEL_VALUE), max_size=3))
    if not pairs and draw(st.booleans()):
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return "{" + body + ("," if pairs and draw(st.booleans()) else "") + "}"


GOOD_VALUE = st.one_of(
    st.integers(0, 10_000).map(str),
    st.integers(0, 10_000).map(lambda n: f"{n}.0"),
    st.floats(0, 1e6).map(repr),
    st.sampled_from(["0", "-0", "+3", ".5", "5.", "1e3", "1E+2", "2.5e-3", "0.0", "1e308"]),
)
BAD_VALUE = st.sampled_from(["NaN", "nan", "+Inf", "-Inf", "Inf", "inf", "-1", "-0.5", "1e999", "-1e999",
                             "9" * 5000, "", "abc", "1_000", "0x10", "1.2.3", "1e", "e5", "--1", "+-1", "3,0",
                             "١", "½", "1e-99999", "Infinity"])  # "1e-99999" is 0.0: a good value, see below
SEP = st.sampled_from([" ", "\t", "  ", " \t"])
TIMESTAMP = st.one_of(st.just(""), st.integers(-(10**15), 10**15).map(lambda t: f" {t}"))
GAUGE_TAIL_INVALID = st.sampled_from(["", " ", "{", '{a="b"', '{a="b} 1', " 1 2 3", " 1 x", " 3 -", "{} ",
                                      '{a="\\"} 1', " 1 1.5", " 1 NaN"])


@st.composite
def sample_line(draw: st.DrawFn, clean: bool) -> tuple[str, Any]:
    """(line, what it means): ("value", float), ("unknown", None) or ("ignored", None); `clean`: no
    line of the gauges that makes the count unknown."""
    kinds = ["good", "good", "good", "bad", "invalid", "other", "comment", "blank"]
    kind = draw(st.sampled_from([k for k in kinds if not clean or k not in ("bad", "invalid")]))
    lead = draw(st.sampled_from(["", "", " ", "\t"]))
    trail = draw(st.sampled_from(["", "", " ", "\t", "\r"]))
    if kind in ("good", "bad"):
        name = draw(st.sampled_from(GAUGES))
        value = draw(GOOD_VALUE if kind == "good" else BAD_VALUE)  # (a few BAD_VALUEs read as 0.0)
        stamp = draw(TIMESTAMP) if value else ""  # without a value, a timestamp would read as the value
        line = f"{lead}{name}{draw(labels())}{draw(SEP)}{value}{stamp}{trail}"
        number = _oracle_value(value)
        return line, ("value", number) if number is not None else ("unknown", None)
    if kind == "invalid":
        return f"{lead}{draw(st.sampled_from(GAUGES))}{draw(GAUGE_TAIL_INVALID)}", ("unknown", None)
    if kind == "other":
        value = draw(GOOD_VALUE | BAD_VALUE)
        return f"{lead}{draw(st.sampled_from(OTHER))}{draw(labels())} {value}{trail}", ("ignored", None)
    if kind == "comment":
        name = draw(st.sampled_from(GAUGES))
        text = draw(st.sampled_from([f"# HELP {name} Number of requests.", f"# TYPE {name} gauge", "# EOF",
                                     f"#{name} NaN", f"# {name} -1", "#"]))
        return f"{lead}{text}", ("ignored", None)
    return lead + trail.replace("\r", ""), ("ignored", None)


def _oracle_value(text: str) -> float | None:
    """An independent reading of one sample value: a plain decimal number, finite and >= 0."""
    t = text.strip()
    body = t[1:] if t[:1] in "+-" else t
    mantissa, _, exponent = body.lower().partition("e")
    if "e" in body.lower() and not (exponent.lstrip("+-").isascii() and exponent.lstrip("+-").isdigit()
                                    and exponent.count("-") + exponent.count("+") <= 1
                                    and exponent[:1] in "+-0123456789"):
        return None
    if mantissa.count(".") > 1 or not mantissa.replace(".", "") or not mantissa.replace(".", "").isascii() \
            or not mantissa.replace(".", "").isdigit():
        return None
    value = float(t)
    return value if math.isfinite(value) and value >= 0 else None


@st.composite
def expositions(draw: st.DrawFn) -> tuple[str, Any]:
    lines = draw(st.lists(sample_line(draw(st.booleans())), max_size=12))
    meanings = [meaning for _, meaning in lines]
    expected: Any
    if any(kind == "unknown" for kind, _ in meanings):
        expected = None
    elif not any(kind == "value" for kind, _ in meanings):
        expected = None
    else:
        total = 0.0
        for kind, v in meanings:
            if kind == "value":
                total += v
        expected = total if math.isfinite(total) else None
    newline = draw(st.sampled_from(["\n", "\n", "\r\n"]))
    return newline.join(line for line, _ in lines) + draw(st.sampled_from(["", newline])), expected


def metrics_inputs() -> st.SearchStrategy[tuple[str, Any]]:
    """(text, the expected result or ANY)."""
    huge = st.sampled_from(["vllm:num_requests_running{" + "a" * 1_000_000, 'vllm:num_requests_running{a="' + "x" * 10**6,
                            "vllm:num_requests_running " + "1 " * 500_000, "#" + "x" * 10**6,
                            "vllm:num_requests_running{" + '"' * 10**6, "vllm:num_requests_running{" + 'a="\\",' * 100_000,
                            "vllm:num_requests_running 1\n" * 100_000, "\n" * 10**6])
    return st.one_of(
        expositions(), expositions(), expositions(),  # weighted: most inputs are structured
        st.text(max_size=300).map(lambda t: (t, ANY)),
        st.text(st.sampled_from([*"vlm:_nurqestigwa{}=\", \t\n#0123456789.eE+-NaInf"]), max_size=300).map(
            lambda t: (t, ANY)),
        st.binary(max_size=300).map(lambda b: (b.decode("latin-1"), ANY)),
        huge.map(lambda t: (t, ANY)),
    )


def check_metrics(item: tuple[str, Any]) -> bool:
    """True: a count (finite, >= 0); False: unknown (None). Never raises."""
    text, expected = item
    result = inflight_from_metrics(text)
    assert result is None or (isinstance(result, float) and math.isfinite(result) and result >= 0), result
    if expected is not ANY:
        assert result == expected, (result, expected, text[:500])
    return result is not None


@settings(max_examples=UNIT_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(metrics_inputs())
@example(("vllm:num_requests_running 1\nvllm:num_requests_waiting -1\n", None))  # was 0.0: a drain finished
@example(('vllm:num_requests_running{model_name="m"} 2\nvllm:num_requests_waiting +Inf\n', None))  # was 2.0
@example(("vllm:num_requests_running 1e999\n", None))  # was inf
@example(("vllm:num_requests_running 1e308\nvllm:num_requests_waiting 1e308\n", None))  # was inf
@example(("vllm:num_requests_running 3\nvllm:num_requests_waiting NaN\n", None))  # was nan
@example(("vllm:num_requests_running 3\nvllm:num_requests_waiting 1e5e5\n", None))  # was 3.0 (skipped)
@example(("vllm:num_requests_running\n", None))  # a missing value: unknown (a gauge line, no number)
@example(('vllm:num_requests_running{model_name="a}b"} 4\n', 4.0))  # a "}" in a label value: was None
@example(("trtllm_num_requests_running 2 1712345678000\n", 2.0))  # a timestamp: was None
def test_fuzz_inflight_from_metrics(item: tuple[str, Any]) -> None:
    check_metrics(item)


@pytest.mark.parametrize(("text", "expected"), [
    ('# HELP vllm:num_requests_running x\nvllm:num_requests_running{model_name="m",engine="0"} 3.0\n'
     'vllm:num_requests_waiting{model_name="m",engine="0"} 2.0\nvllm:num_requests_waiting_by_reason{reason="x"} 9\n',
     5.0),
    ("trtllm_num_requests_running 0\ntrtllm_num_requests_waiting 0\n", 0.0),
    ("something_else 1\n", None),
    ("", None),
    ("vllm:num_requests_running -0\n", 0.0),
    ("  vllm:num_requests_running 2 \r\n", 2.0),
    ("vllm:num_requests_running 2\nvllm:num_requests_waiting 1_000\n", None),
])
def test_inflight_readings(text: str, expected: float | None) -> None:
    assert inflight_from_metrics(text) == expected


@pytest.mark.parametrize("function", [inflight_from_metrics, inflight_from_prometheus])
def test_docstring_examples_hold(function: Any) -> None:
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    (test,) = finder.find(function, function.__name__, globs=vars(executor))
    runner.run(test)
    assert test.examples and runner.failures == 0


# --- the Prometheus fallback ------------------------------------------------------------------------

PROM_VALUE = st.one_of(st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -0.0, 0.0, 1e308,
                                                     -5e-324, 5e-324]))


@settings(max_examples=UNIT_EXAMPLES, deadline=None, database=None)
@given(st.lists(PROM_VALUE, max_size=3))
@example([math.nan])  # was nan: a sum over a NaN gauge
@example([math.inf])  # was inf
@example([-math.inf])  # was -inf: drain_step counted it idle (inflight <= 0), a drain finished
@example([-1.0])  # was -1.0: idle too
@example([-5e-324])  # was -5e-324: idle too
def test_fuzz_inflight_from_prometheus(values: list[float]) -> None:
    result = inflight_from_prometheus(values)
    assert result is None or (isinstance(result, float) and math.isfinite(result) and result >= 0), result
    one_count = len(values) == 1 and math.isfinite(values[0]) and values[0] >= 0
    assert result == (values[0] if one_count else None), (values, result)
    if result is None:  # unknown never finishes a drain
        progress = act.DrainProgress(0.0, zeros=1)
        assert act.drain_step(progress, result, 1.0, 120.0)[0] is act.DrainStep.WAIT


def _row() -> ReplicaRow:
    return ReplicaRow("r00001", "gpu-01", "llama", "vllm", "h100", 1, "bf16", (0,), 8000, "vllm", Phase.DRAINING,
                      "planned", 0.0, 0.0, 0.0, 0.0)


def _answer(value: str | None) -> httpx.Response:
    """Prometheus' answer to the instant query (`value` as the API writes it; None: an empty vector)."""
    result = [] if value is None else [{"metric": {}, "value": [1712345678.0, value]}]
    return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": result}})


@pytest.mark.parametrize(("answer", "expected"), [
    ("NaN", None), ("+Inf", None), ("-Inf", None), ("-1", None), ("-0.5", None), ("nonsense", None),
    (None, None), ("3", 3.0), ("0", 0.0),
    ("error", None),  # Prometheus answered an error
])
async def test_executor_inflight_prometheus_fallback(monkeypatch: pytest.MonkeyPatch, answer: str | None,
                                                     expected: float | None) -> None:
    """Executor.inflight itself: the engine's /metrics refuses the connection, Prometheus answers."""
    queries: list[str] = []

    def prometheus(request: httpx.Request) -> httpx.Response:
        queries.append(request.url.params["query"])
        if answer == "error":
            return httpx.Response(400, json={"status": "error", "errorType": "bad_data", "error": "x"})
        return _answer(answer)

    def engine(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    prom = PromClient("http://prometheus:9090")
    await prom.aclose()
    real_client = httpx.AsyncClient
    prom._client = real_client(base_url=prom.base_url, transport=httpx.MockTransport(prometheus))
    monkeypatch.setattr(httpx, "AsyncClient",
                        lambda **kw: real_client(transport=httpx.MockTransport(engine), **kw))
    ex = Executor(settings=ControllerSettings(), store=None, link=None, hosts=None, alerts={},
                  metrics=None, prom=prom, lock=None, policy=None)
    try:
        result = await ex.inflight(_row())
    finally:
        await prom.aclose()
    assert result == expected and (result is None or math.isfinite(result)), result
    (query,) = queries
    assert query.startswith("sum(") and 'replica="r00001"' in query, query
    # the drain never finishes on it: two polls of an unknown count wait (a known 0 finishes)
    progress = act.DrainProgress(0.0)
    for _ in range(2):
        step, progress = act.drain_step(progress, result, 1.0, 120.0)
    assert (step is act.DrainStep.DONE) == (expected == 0.0), step
