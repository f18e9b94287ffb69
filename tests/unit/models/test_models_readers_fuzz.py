"""Whatever a benchmark file holds, a reader returns points or raises BenchmarkFormatError: nothing
else escapes (the fit command lists the file with the reason and goes on)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from fleetplan.models.bench import BenchmarkFormatError, Metadata
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.models.readers import read_benchmark

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "bench"
META = Metadata(model="m", engine=Engine.VLLM, gpu=GpuType.H100, tp=1, precision=Precision.BF16)
VLLM = {"model_id": "m", "backend": "vllm", "completed": 10, "total_input_tokens": 1000,
        "total_output_tokens": 500, "request_rate": "inf", "max_concurrency": 4,
        "request_throughput": 1.9, "output_throughput": 95.0, "mean_ttft_ms": 30.0, "p99_itl_ms": 9.0}
INFX = {"model_id": "m", "completed": 8, "total_input_tokens": 800, "total_output_tokens": 80,
        "request_rate": "inf", "max_concurrency": 8, "request_throughput": 1.0, "output_throughput": 10.0,
        "median_ttft": 0.2, "p99_ttft": 0.5, "median_tpot": 0.02, "p99_tpot": 0.03}
DOCS: list[tuple[str, dict[str, Any]]] = [
    ("run_vllm.json", VLLM),
    ("m_fp8_vllm_tp8_isl100_osl10_conc8.json", INFX),
    ("trtllm_report.json", json.loads((FIXTURES / "trtllm_bench_llama8b_h100_report.json").read_text())),
    ("profile_export_aiperf.json", json.loads((FIXTURES / "profile_export_aiperf.json").read_text())),
]
junk = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=5), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3),
                                                                                             st.integers(), max_size=2))


def _paths(doc: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append((*prefix, k))
            out.extend(_paths(v, (*prefix, k)))
    return out


def _mutate(doc: Any, path: tuple[str, ...], value: Any, delete: bool) -> Any:
    out = dict(doc)
    if len(path) == 1:
        if delete:
            out.pop(path[0], None)
        else:
            out[path[0]] = value
    else:
        out[path[0]] = _mutate(doc[path[0]], path[1:], value, delete)
    return out


CASES = [(name, doc, path) for name, doc in DOCS for path in _paths(doc)]


AIPERF_ISL = next(c for c in CASES if c[0] == "profile_export_aiperf.json" and c[2] == ("input_sequence_length", "avg"))


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), value=junk, delete=st.booleans())
@example(case=AIPERF_ISL, value=0, delete=False)  # a zero mean prompt was read as a point with isl 0
def test_mutated_json_never_crashes(case: tuple[str, dict[str, Any], tuple[str, ...]], value: Any,
                                    delete: bool) -> None:
    name, doc, path = case
    text = json.dumps(_mutate(doc, path, value, delete))
    try:
        result = read_benchmark(text, name, META)
    except BenchmarkFormatError as exc:
        assert str(exc).startswith(name)
        return
    for p in result.points:
        assert p.isl > 0 and p.osl > 0 and isinstance(p.model, str)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=200))
def test_arbitrary_text_never_crashes(text: str) -> None:
    try:
        read_benchmark(text, "x.csv", META)
    except BenchmarkFormatError:
        pass


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(1, 400))
def test_truncated_documents_never_crash(cut: int) -> None:
    for name, doc in DOCS:
        text = json.dumps(doc)
        try:
            read_benchmark(text[: min(cut, len(text) - 1)], name, META)
        except BenchmarkFormatError:
            pass


ONLINE_HEADER = ("engine,version,precision,frontend,model,gpu,tp,isl,osl,qps,req_throughput_rps,mean_ttft_ms,"
                 "mean_itl_ms,total_token_tput_tok_s,output_tput_tok_s")
ONLINE_ROW = "tensorrt-llm,0.14.0,bf16,triton,LLaMA 3.1 8B,H100 80GB HBM3,1,467,256,2,2,23,8,1423,504"
cell = st.one_of(st.sampled_from(["", "INF", "-1", "nan", "0", "1e309", "abc", "H999", "fp7", "1.5", '"1,5"']),
                 st.text(alphabet="0123456789.-eE", max_size=6))


@settings(max_examples=200, deadline=None)
@given(col=st.integers(0, 14), value=cell)
def test_mutated_table_cell_is_a_row_problem_or_a_point(col: int, value: str) -> None:
    cells = ONLINE_ROW.split(",")
    cells[col] = value
    text = f"{ONLINE_HEADER}\n{ONLINE_ROW}\n{','.join(cells)}\n"
    result = read_benchmark(text, "table.csv")  # the good row always reads, so the file does
    assert len(result.points) + len(result.problems) == 2
    assert all(p.startswith("table.csv:3: ") for p in result.problems)
