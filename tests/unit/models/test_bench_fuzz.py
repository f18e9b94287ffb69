"""Fuzzing the benchmark file formats against the real reader (`read_benchmark`): vllm bench serve
JSON (and its InferenceX variant, times in seconds), trtllm-bench --report_json, AIPerf JSON,
genai-perf CSV and the TensorRT-LLM / seed-articles CSV tables.

Property: whatever the file holds, read_benchmark returns points whose every number is finite and
non-negative (tp an integer 1..64, the TP sizes the policy and the MQTT protocol accept; the model
name one line of printable text, at most 256 characters), each skipped row named as
`<file>:<line>: ...`, or raises
BenchmarkFormatError: one line, starting with the file name, no longer than MAX_MESSAGE; nothing
else escapes (no OverflowError, RecursionError, AttributeError, ...). Inputs: small valid documents
of each format (written here from what the reader accepts) mutated 1-3 times (a value replaced by
NaN, Infinity, 1e308, 1e999, -1, 0, 65, 1e300, a 400-digit integer, a 5,000-digit number, null, a
string (100 kB, holding a newline, NUL or U+2028), a list, a dict, deep nesting; a key dropped or renamed; a CSV cell replaced, a row given too many or
too few cells, a header renamed), truncated documents, random text, random bytes as text.

The example counts here keep this file to a few seconds; `bench/fuzz_wire.py --only benchmark`
runs the same property with 10,000 examples.
"""

from __future__ import annotations

import copy
import csv
import io
import math
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fleetplan.models.bench import BenchmarkFormatError, BenchmarkPoint, Metadata
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.models.readers import read_benchmark
from tests.fuzz_helpers import Raw, raw_json, value_slots

UNIT_EXAMPLES = 300  # bench/fuzz_wire.py: 10,000
MAX_MESSAGE = 1_000  # a rejection is one readable line, whatever the file held
META = Metadata(model="m", engine=Engine.VLLM, gpu=GpuType.H100, tp=1, precision=Precision.BF16)
NO_META = Metadata()

# --- small valid documents of each format --------------------------------------------------------

VLLM = {"date": "20250101-000000", "backend": "vllm", "model_id": "meta-llama/Llama-3.1-8B-Instruct",
        "tensor_parallel_size": 1, "num_prompts": 10, "request_rate": "inf", "max_concurrency": 4,
        "duration": 5.2, "completed": 10, "total_input_tokens": 1000, "total_output_tokens": 500,
        "request_throughput": 1.9, "output_throughput": 95.0, "total_token_throughput": 285.0,
        "mean_ttft_ms": 30.0, "median_ttft_ms": 29.0, "p99_ttft_ms": 50.0,
        "mean_tpot_ms": 8.0, "median_tpot_ms": 7.9, "p99_tpot_ms": 9.5,
        "mean_itl_ms": 8.1, "median_itl_ms": 8.0, "p99_itl_ms": 9.0}
INFERENCEX = {"model_id": "zai-org/GLM-5-FP8", "completed": 8, "total_input_tokens": 800,
              "total_output_tokens": 80, "request_rate": "inf", "max_concurrency": 8,
              "request_throughput": 1.0, "output_throughput": 10.0, "median_ttft": 0.2, "p99_ttft": 0.5,
              "mean_ttft": 0.25, "median_tpot": 0.02, "p99_tpot": 0.03, "median_itl": 0.02}
TRTLLM = {"engine": {"model": "meta-llama/Llama-3.1-8B-Instruct", "dtype": "bfloat16", "quantization": "FP8"},
          "machine": {"name": "NVIDIA H100 80GB HBM3"},
          "world_info": {"tp_size": 1, "pp_size": 1},
          "request_info": {"num_requests": 3000, "avg_input_length": 128.0, "avg_output_length": 2048.0},
          "performance": {"request_throughput_req_s": 10.3, "system_output_throughput_tok_s": 21124.1},
          "streaming_metrics": {"avg_ttft_ms": 5321.4, "avg_tpot_ms": 66.0,
                                "ttft_percentiles": {"p50": 4800.3, "p99": 10500.7, "average": 5321.4},
                                "tpot_percentiles": {"p50": 65.7, "p99": 73.9, "average": 66.0}}}
AIPERF = {"request_throughput": {"unit": "requests/sec", "avg": 5.21},
          "time_to_first_token": {"unit": "ms", "avg": 61.3, "p50": 57.9, "p99": 120.5},
          "inter_token_latency": {"unit": "ms", "avg": 11.5, "p50": 11.3, "p99": 14.9},
          "output_token_throughput": {"unit": "tokens/sec", "avg": 666.9},
          "input_sequence_length": {"unit": "tokens", "avg": 550.0},
          "output_sequence_length": {"unit": "tokens", "avg": 128.0},
          "telemetry_data": {"endpoints": {"localhost:9401": {"gpus": {"gpu_0": {"gpu_name": "NVIDIA H100"}}}}},
          "input_config": {"endpoint": {"model_names": ["meta-llama/Llama-3.1-8B-Instruct"]},
                           "loadgen": {"concurrency": 8}}}
# CSV documents: lists of rows of cells (a blank row separates genai-perf's two sections)
GENAI_PERF = [["Metric", "avg", "min", "max", "p99", "p50"],
              ["Time To First Token (ms)", "71.66", "64.32", "86.52", "76.13", "71.10"],
              ["Inter Token Latency (ms)", "18.47", "18.25", "18.72", "18.67", "18.45"],
              ["Output Sequence Length (tokens)", "15.96", "12.00", "16.00", "16.00", "16.00"],
              ["Input Sequence Length (tokens)", "549.66", "548.00", "551.00", "550.00", "550.00"],
              [],
              ["Metric", "Value"],
              ["Output Token Throughput (per sec)", "1,367.84"],
              ["Request Throughput (per sec)", "22.87"]]
ONLINE = [["engine", "version", "precision", "frontend", "model", "gpu", "tp", "isl", "osl", "qps",
           "req_throughput_rps", "mean_ttft_ms", "mean_itl_ms", "total_token_tput_tok_s", "output_tput_tok_s"],
          ["tensorrt-llm", "0.14.0", "bf16", "triton", "LLaMA 3.1 8B", "H100 80GB HBM3", "1", "467", "256", "2",
           "2", "23", "8", "1423", "504"],
          ["tensorrt-llm", "0.14.0", "bf16", "triton", "LLaMA 3.1 8B", "H100 80GB HBM3", "1", "467", "256", "INF",
           "9.5", "800", "30", "7000", "2400"]]
THROUGHPUT = [["engine", "version", "method", "model", "gpu", "precision", "tp", "isl", "osl",
               "total_output_throughput_tok_s"],
              ["tensorrt-llm", "1.0", "trtllm-bench (offline, max load)", "Llama 3.1 8B", "H100", "FP8", "1", "128",
               "128", "25342"],
              ["tensorrt-llm", "1.0", "trtllm-bench (offline, max load)", "Llama 3.1 8B", "B200", "FP4", "2", "1024",
               "2048", "19954"]]
SEED = [["source", "engine", "model", "gpu", "gpus", "tp", "precision", "workload", "batch_or_concurrency",
         "request_rate_rps", "throughput_tok_s", "note"],
        ["rtx-article", "vllm", "Llama-3-8B", "RTX 4090", "1", "1", "bf16", "static batch ISL 128 OSL 100", "8", "",
         "89.1", "per request"],
        ["rtx-article", "tensorrt-llm", "Llama-3-8B", "RTX 4090", "1", "1", "bf16", "chat ISL 128 OSL 100", "16", "",
         "1400", ""]]

# (name the reader sees, the CLI's metadata, the document): the names carry what the file lacks
JSON_DOCS: list[tuple[str, Metadata, dict[str, Any]]] = [
    ("run_vllm.json", META, VLLM),
    ("glm5_fp8_vllm_tp8_isl100_osl10_conc8.json", Metadata(gpu=GpuType.H200), INFERENCEX),
    ("trtllm_report.json", NO_META, TRTLLM),
    ("profile_export_aiperf.json", META, AIPERF),
]
CSV_DOCS: list[tuple[str, Metadata, list[list[str]]]] = [
    ("llama-openai-chat-concurrency8/profile_export_genai_perf.csv", META, GENAI_PERF),
    ("trtllm_online_serving.csv", NO_META, ONLINE),
    ("trtllm_perf_overview_throughput.csv", NO_META, THROUGHPUT),
    ("seed_articles.csv", NO_META, SEED),
]


def encode(doc: Any) -> str:
    return raw_json(doc)


def write_csv(rows: list[list[str]]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue()


# --- hostile values ------------------------------------------------------------------------------

HUGE = [1e308, -1e308, 2**63, 10**400, -(10**400), 5e-324, 1e300, 64, 65, 64.5]
RAW_TOKENS = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"), Raw("-1e999"), Raw("9" * 5000),
              Raw("[" * 990 + "]" * 990), Raw("[" * 100_000 + "]" * 100_000),
              Raw('{"a":' * 900 + "1" + "}" * 900)]
HOSTILE_JSON: st.SearchStrategy[Any] = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([-1, 0, 1, *HUGE]),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.sampled_from(["inf", "-inf", "NaN", "1e999", "-1", "0", "1,000", "1e308", "N/A", "", " ", "9" * 400,
                     "x" * 100_000, "\u0000", "h100\n", "sec", "ns", "tokens", "m" * 256, "m" * 257,
                     "llama\n8b", "llama\r", "a\u0000b", "a\tb", "a\u2028b", "a\u200bb", "a\x7fb", " llama "]),
    st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.sampled_from(RAW_TOKENS),
)
HOSTILE_CELL: st.SearchStrategy[str] = st.one_of(
    st.sampled_from(["", " ", "nan", "NaN", "inf", "INF", "-inf", "Infinity", "-1", "0", "1e308", "1e309",
                     "1e999", "5e-324", "9" * 400, "9" * 5000, "1,5", "1_000", "N/A", "null", "abc", "H999",
                     "fp7", '"', "\n", "a,b", "\u0000", "\ufeff", "x" * 200_000, "64", "65", "1e300", "8.0",
                     "m" * 257, "Llama\x01 8B", "Llama\u2028 8B",
                     "static batch ISL 1e308 OSL 100", "ISL " + "9" * 400 + " OSL 1", "ISL 0 OSL 0",
                     "Time To First Token (fortnights)", "Metric"]),
    st.text(alphabet="0123456789.-+eE,", max_size=8), st.text(max_size=10),
)




@st.composite
def mutated_json(draw: st.DrawFn, base: dict[str, Any]) -> str:
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        slots = value_slots(doc)
        if not slots:
            break
        container, key = draw(st.sampled_from(slots))
        action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "rename", "extra"]))
        if action == "replace":
            container[key] = draw(HOSTILE_JSON)
        elif action == "delete":
            del container[key]
        elif action == "rename" and isinstance(container, dict):
            container[draw(st.text(max_size=8)) + str(key)] = container.pop(key)
        elif isinstance(container, dict):
            container[draw(st.text(max_size=8))] = draw(HOSTILE_JSON)
        else:
            container.append(draw(HOSTILE_JSON))
    return encode(doc)


@st.composite
def mutated_csv(draw: st.DrawFn, base: list[list[str]]) -> str:
    rows = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        r = draw(st.integers(0, len(rows) - 1))
        row = rows[r]
        action = draw(st.sampled_from(["cell", "cell", "cell", "more_cells", "fewer_cells", "drop_row", "dup_row",
                                       "header"]))
        if action == "cell" and row:
            row[draw(st.integers(0, len(row) - 1))] = draw(HOSTILE_CELL)
        elif action == "more_cells":
            row.extend(draw(st.lists(HOSTILE_CELL, min_size=1, max_size=4)))
        elif action == "fewer_cells" and row:
            del row[draw(st.integers(0, len(row) - 1)):]
        elif action == "drop_row" and len(rows) > 1:
            del rows[r]
        elif action == "dup_row":
            rows.insert(r, list(row))
        elif rows[0]:
            rows[0][draw(st.integers(0, len(rows[0]) - 1))] = draw(st.sampled_from(["", "Metric", "isl", "x", "qps"]))
    if draw(st.booleans()):
        return write_csv(rows)
    return "\n".join(",".join(row) for row in rows) + "\n"  # unquoted: cells with commas/quotes break rows


def _docs() -> list[tuple[str, Metadata, str]]:
    return [(n, m, encode(d)) for n, m, d in JSON_DOCS] + [(n, m, write_csv(d)) for n, m, d in CSV_DOCS]


def _truncated(name: str, meta: Metadata, text: str) -> st.SearchStrategy[tuple[str, str, Metadata]]:
    return st.integers(0, len(text)).map(lambda n: (text[:n], name, meta))


def _random(text: st.SearchStrategy[str]) -> st.SearchStrategy[tuple[str, str, Metadata]]:
    return st.tuples(text, st.sampled_from([n for n, _, _ in _docs()]), st.sampled_from([META, NO_META]))


def benchmark_inputs() -> st.SearchStrategy[tuple[str, str, Metadata]]:
    """(text, file name, metadata): mostly near-valid documents of every format."""
    mutants = [mutated_json(d).map(lambda t, n=n, m=m: (t, n, m)) for n, m, d in JSON_DOCS]
    mutants += [mutated_csv(d).map(lambda t, n=n, m=m: (t, n, m)) for n, m, d in CSV_DOCS]
    return st.one_of(
        *mutants, *mutants,  # weighted: most inputs are near-valid documents
        st.one_of(*(_truncated(n, m, t) for n, m, t in _docs())),
        _random(st.text(alphabet=st.sampled_from([*'{}[]",:0123456789.eE-+ \nNaInfyulrtse\ufeff'])
                        , max_size=200)),
        _random(st.text(max_size=200)),
        _random(st.binary(max_size=300).map(lambda b: b.decode("latin-1"))),
        _random(st.sampled_from(["[" * 100_000, "{" * 50_000, "[" * 990 + "]" * 990, '{"a":' * 5000,
                                 "x" * 300_000, "a,b\n" + "1," * 100_000, "\ufeff\n\n\n", "Metric,\n" * 1000])),
    )


# --- the property ---------------------------------------------------------------------------------

NUMBERS = [f.name for f in fields(BenchmarkPoint) if f.name not in (
    "source", "model", "engine", "gpu", "tp", "precision", "load", "variant", "series")]


def check_benchmark(item: tuple[str, str, Metadata]) -> bool:
    """True: read (every point sane); False: rejected with a clear one-line error naming the file."""
    text, name, meta = item
    try:
        result = read_benchmark(text, name, meta)
    except BenchmarkFormatError as exc:
        message = str(exc)
        assert message.startswith(f"{name}: ") or message.startswith(f"{name}:"), message[:300]
        assert "\n" not in message and "\r" not in message, message[:300]
        assert len(message) <= MAX_MESSAGE + len(name), message[:300]
        return False
    assert result.points
    for p in result.points:
        assert p.source.startswith(name), p.source
        assert isinstance(p.tp, int) and not isinstance(p.tp, bool) and 1 <= p.tp <= 64, p
        assert 1 <= len(p.model) <= 256 and p.model.isprintable(), p.model[:300]
        for f in NUMBERS:
            v = getattr(p, f)
            assert v is None or (isinstance(v, float | int) and math.isfinite(v) and v >= 0), (f, v, p)
        assert p.isl is not None and p.osl is not None and p.osl > 0, p
    for problem in result.problems:
        assert problem.startswith(f"{name}:"), problem[:300]
        assert "\n" not in problem and len(problem) <= MAX_MESSAGE + len(name), problem[:300]
    return True


# regression inputs found by this file (each was a crash or an out-of-range point before the fix)
_V = "run_vllm.json"
_CSV_THROUGHPUT = write_csv(THROUGHPUT)


@settings(max_examples=UNIT_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(benchmark_inputs())
@example((encode({**VLLM, "completed": 5e-324}), _V, META))  # isl = tokens / completed overflowed
@example((encode({**VLLM, "total_input_tokens": 10**400}), _V, META))  # int too large for a float
@example((encode({**INFERENCEX, "median_ttft": 1e308}), JSON_DOCS[1][0], JSON_DOCS[1][1]))  # s -> ms overflow
@example((_CSV_THROUGHPUT + _CSV_THROUGHPUT.splitlines()[1] + ",1,2\n", "t.csv", NO_META))  # extra cells
@example((write_csv([SEED[0], [*SEED[1][:7], "static batch ISL 128 OSL 100", "8", "", "5e-324", ""]]),
          "seed_articles.csv", NO_META))  # ITL = 1000 / speed overflowed
@example((write_csv([SEED[0], [*SEED[1][:7], "ISL " + "9" * 400 + " OSL 100", "8", "", "10", ""]]),
          "seed_articles.csv", NO_META))  # workload ISL overflowed
@example((encode({**VLLM, "output_throughput": "x" * 100_000}), _V, META))  # 100 kB message
@example((encode({**VLLM, "model_id": Raw("[" * 990 + "]" * 990)}), _V, META))  # deep value in message
@example(("\ufeff" + _CSV_THROUGHPUT, "t.csv", NO_META))  # BOM before the header
@example((encode({**VLLM, "tensor_parallel_size": 1e300}), _V, META))  # read as a 301-digit TP size
@example((encode({**TRTLLM, "world_info": {"tp_size": 65}}), JSON_DOCS[2][0], NO_META))  # TP 65 accepted
@example((_CSV_THROUGHPUT.replace(",FP8,1,", ",FP8,1e300,"), "t.csv", NO_META))  # a CSV cell: the same
@example((encode({**VLLM, "model_id": "m" * 100_000}), _V, META))  # a 100 kB model name accepted
@example((encode({**VLLM, "model_id": "llama\n8b"}), _V, META))  # a newline in a model name accepted
@example((encode({**AIPERF, "input_config": {"endpoint": {"model_names": ["a\u0000b"]}, "loadgen": {"concurrency": 8}}}),
          JSON_DOCS[3][0], META))  # a NUL in a model name accepted
def test_fuzz_benchmark_files(item: tuple[str, str, Metadata]) -> None:
    check_benchmark(item)


# --- hand-written cases ---------------------------------------------------------------------------


def test_the_valid_documents_read() -> None:
    for name, meta, text in _docs():
        assert check_benchmark((text, name, meta)), name


@pytest.mark.parametrize(("text", "name", "needles"), [
    (encode({**VLLM, "completed": 5e-324}), _V,
     ["field 'total_input_tokens' / field 'completed' (1000 / 4.94066e-324) = inf: out of range"]),
    (encode({**VLLM, "total_input_tokens": 10**400}), _V, ["'total_input_tokens'", "finite", "1000000"]),
    (encode({**INFERENCEX, "median_ttft": 1e308}), JSON_DOCS[1][0], ["'median_ttft'", "finite", "1e+308"]),
    (encode({**VLLM, "output_throughput": "x" * 100_000}), _V, ["'output_throughput'", "'xxxx", "..."]),
    (write_csv([SEED[0], [*SEED[1][:7], "ISL " + "9" * 400 + " OSL 100", "8", "", "10", ""]]), "seed_articles.csv",
     ["seed_articles.csv:2: field 'workload ISL'", "finite"]),
    (write_csv([SEED[0], [*SEED[1][:7], "static batch ISL 128 OSL 100", "8", "", "5e-324", ""]]),
     "seed_articles.csv", ["seed_articles.csv:2: 1000 / field 'throughput_tok_s' (1000 / 4.94066e-324) = inf"]),
])
def test_out_of_range_values_are_named(text: str, name: str, needles: list[str]) -> None:
    meta = next((m for n, m, _ in JSON_DOCS if n == name), NO_META)
    with pytest.raises(BenchmarkFormatError) as err:
        read_benchmark(text, name, meta)
    message = str(err.value)
    for needle in needles:
        assert needle in message, (needle, message)


def test_a_row_with_extra_cells_is_a_row_problem_and_the_others_read() -> None:
    text = _CSV_THROUGHPUT + write_csv([[*THROUGHPUT[1], "1", "2"]])
    result = read_benchmark(text, "t.csv")
    assert len(result.points) == 2
    (problem,) = result.problems
    assert problem == "t.csv:4: row has 12 cells, the header 10", problem


def test_a_bom_before_the_header_is_not_part_of_the_first_column() -> None:
    result = read_benchmark("\ufeff" + _CSV_THROUGHPUT, "t.csv")
    assert [p.engine for p in result.points] == [Engine.TRTLLM, Engine.TRTLLM]


_NO_TP = {k: v for k, v in VLLM.items() if k != "tensor_parallel_size"}


@pytest.mark.parametrize(("text", "name", "meta", "needles"), [
    # "tp": 1e300 read as a 301-digit TP size; 65 is past the largest TP the policy and MQTT accept
    (encode({**VLLM, "tensor_parallel_size": 1e300}), _V, META, ["run_vllm.json: field 'tp' must be 1..64", "1e+300"]),
    (encode({**VLLM, "tensor_parallel_size": 65}), _V, META, ["field 'tp' must be 1..64", "got 65"]),
    (encode({**TRTLLM, "world_info": {"tp_size": 10**30}}), "trtllm_report.json", NO_META,
     ["trtllm_report.json: field 'tp' must be 1..64", "got 1000000000000000000000000000000"]),
    (write_csv([THROUGHPUT[0], [*THROUGHPUT[1][:6], "1e300", *THROUGHPUT[1][7:]]]), "t.csv", NO_META,
     ["t.csv:2: field 'tp' must be 1..64", "'1e300'"]),
    (encode(_NO_TP), "run_vllm_tp128.json", META, ["field 'tp' (from the file name) must be 1..64", "got 128"]),
    (encode(_NO_TP), _V, Metadata(model="m", engine=Engine.VLLM, gpu=GpuType.H100, tp=0, precision=Precision.BF16),
     ["field 'tp' (--tp) must be 1..64", "got 0"]),
    # model names: 100 kB, a newline, a NUL, U+2028 (a line break to str.splitlines), a zero-width space
    (encode({**VLLM, "model_id": "m" * 100_000}), _V, META,
     ["run_vllm.json: field 'model' is longer than 256 characters: 'mmmm", "...mmmm"]),
    (encode({**VLLM, "model_id": "llama\n8b"}), _V, META,
     ["field 'model' holds a non-printable character", r"'llama\n8b'"]),
    (encode({**VLLM, "model_id": "a\u0000b"}), _V, META, ["field 'model' holds a non-printable", r"'a\x00b'"]),
    (encode({**VLLM, "model_id": "a\u2028b"}), _V, META, ["field 'model' holds a non-printable", r"'a\u2028b'"]),
    (encode({**VLLM, "model_id": "a\u200bb"}), _V, META, ["field 'model' holds a non-printable", r"'a\u200bb'"]),
    (write_csv([THROUGHPUT[0], [*THROUGHPUT[1][:3], "Llama\x01 8B", *THROUGHPUT[1][4:]]]), "t.csv", NO_META,
     ["t.csv:2: field 'model' holds a non-printable", r"'Llama\x01 8B'"]),
    (encode({k: v for k, v in VLLM.items() if k != "model_id"}), _V,
     Metadata(model="a\tb", engine=Engine.VLLM, gpu=GpuType.H100, tp=1, precision=Precision.BF16),
     ["field 'model' (--model) holds a non-printable", r"'a\tb'"]),
])
def test_tp_and_model_name_out_of_bounds_are_named(text: str, name: str, meta: Metadata,
                                                   needles: list[str]) -> None:
    with pytest.raises(BenchmarkFormatError) as err:
        read_benchmark(text, name, meta)
    message = str(err.value)
    assert message.startswith(f"{name}") and "\n" not in message and len(message) < 300, message
    for needle in needles:
        assert needle in message, (needle, message)


def test_tp_and_model_name_at_their_bounds_read() -> None:
    (p,) = read_benchmark(encode({**VLLM, "tensor_parallel_size": 64.0, "model_id": "m" * 256}), _V, META).points
    assert (p.tp, p.model) == (64, "m" * 256) and type(p.tp) is int
    (p,) = read_benchmark(encode({**VLLM, "model_id": " LLaMA 3.1 8B "}), _V, META).points  # spaces: a spelling
    assert p.model == "LLaMA 3.1 8B"
    (p,) = read_benchmark(encode(_NO_TP), "run_vllm_tp64.json", META).points
    assert p.tp == 64


def test_a_file_name_with_thousands_of_tp_digits_is_no_hint() -> None:
    # int() refuses more than 4,300 digits: the name's 'tp999...' token is not a TP hint at all
    from fleetplan.models.readers import file_hints

    assert file_hints("run_tp" + "9" * 5000 + ".json").tp is None
    assert file_hints("llama_vllm_tp4_h100.json").tp == 4
