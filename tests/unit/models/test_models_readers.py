"""Benchmark readers on the real files of data/ (the repository's copy of the public data) and on
fixtures written from the formats' public source (tests/fixtures/bench)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fleetplan.models.bench import BenchmarkFormatError, LoadKind, Metadata
from fleetplan.models.names import Engine, GpuType, ModelAliases, Precision
from fleetplan.models.readers import file_hints, read_benchmark

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "bench"
H100_BF16_TP1 = Metadata(gpu=GpuType.H100, precision=Precision.BF16, tp=1)


def _read(path: Path, meta: Metadata | None = None, aliases: ModelAliases | None = None):  # type: ignore[no-untyped-def]
    return read_benchmark(path.read_text(), str(path), meta, aliases)


def test_vllm_bench_serve_real_file(shared_data: Path) -> None:
    path = next((shared_data / "benchmarks" / "vllm-bench-serve-example").glob("*.json"))
    raw = json.loads(path.read_text())
    (p,) = _read(path, H100_BF16_TP1).points
    assert p.engine is Engine.VLLM  # from the directory name; the file says backend "openai"
    assert p.model == "tiny-llama"
    assert p.load is LoadKind.CONCURRENCY and p.concurrency == 8  # request_rate inf + max_concurrency 8
    assert p.isl == pytest.approx(raw["total_input_tokens"] / raw["completed"])
    assert p.osl == pytest.approx(32.0)
    assert p.ttft_mean_ms == pytest.approx(raw["mean_ttft_ms"])
    assert p.ttft_p50_ms == pytest.approx(raw["median_ttft_ms"])
    assert p.itl_p99_ms == pytest.approx(raw["p99_itl_ms"])
    assert p.tpot_mean_ms == pytest.approx(raw["mean_tpot_ms"])
    assert p.output_tok_s == pytest.approx(raw["output_throughput"])


def test_vllm_bench_serve_needs_the_gpu(shared_data: Path) -> None:
    path = next((shared_data / "benchmarks" / "vllm-bench-serve-example").glob("*.json"))
    with pytest.raises(BenchmarkFormatError, match=r"field 'gpu' is missing; give it with --gpu") as err:
        _read(path, Metadata(tp=1, precision=Precision.BF16))
    assert path.name in str(err.value)


def test_inferencex_real_file_times_in_seconds_metadata_from_name(shared_data: Path) -> None:
    path = shared_data / "benchmarks" / "vllm-inferencex" / "glm5_fp8_vllm_tp8_isl6144_osl128_conc8.json"
    raw = json.loads(path.read_text())
    (p,) = _read(path, Metadata(gpu=GpuType.H200)).points
    assert (p.engine, p.tp, p.precision, p.gpu) == (Engine.VLLM, 8, Precision.FP8, GpuType.H200)
    assert p.model == "GLM-5-FP8"
    assert p.ttft_p50_ms == pytest.approx(raw["median_ttft"] * 1000.0)
    assert p.ttft_p99_ms == pytest.approx(raw["p99_ttft"] * 1000.0)
    assert p.tpot_p50_ms == pytest.approx(raw["median_tpot"] * 1000.0)
    assert p.itl_like_p50_ms == p.tpot_p50_ms and p.ttft_mean_ms is None
    assert (p.isl, p.osl, p.concurrency) == (6144, 128, 8)


def test_inferencex_dep_is_a_separate_variant(shared_data: Path) -> None:
    d = shared_data / "benchmarks" / "vllm-inferencex"
    meta = Metadata(gpu=GpuType.H200, precision=Precision.FP8)
    (dep,) = _read(d / "minimax_m25_vllm_dep8_isl1024_osl128_conc8.json", meta).points
    (tep,) = _read(d / "minimax_m25_vllm_tep8_isl1024_osl128_conc8.json", meta).points
    assert dep.tp == tep.tp == 8
    assert dep.key != tep.key and dep.key.model == "MiniMax-M2.5+dep8"


def test_inferencex_precision_missing_is_named(shared_data: Path) -> None:
    path = shared_data / "benchmarks" / "vllm-inferencex" / "minimax_m25_vllm_tep8_isl1024_osl128_conc8.json"
    with pytest.raises(BenchmarkFormatError, match="'precision' is missing"):
        _read(path, Metadata(gpu=GpuType.H200))


def test_trtllm_online_table(shared_data: Path) -> None:
    r = _read(shared_data / "benchmarks" / "trtllm_v0.14_online_serving_triton_bf16.csv")
    assert len(r.points) == 48 and not r.problems
    first = r.points[0]
    assert (first.engine, first.gpu, first.tp, first.precision) == (Engine.TRTLLM, GpuType.H100, 4, Precision.BF16)
    assert first.load is LoadKind.RATE and first.rate_rps == 2 and first.ttft_mean_ms == 62
    assert first.itl_mean_ms == 21 and first.output_tok_s == 498
    inf_rows = [p for p in r.points if p.load is LoadKind.MAX]
    assert len(inf_rows) == 8 and all(p.rate_rps is None for p in inf_rows)
    assert {p.gpu for p in r.points} == {GpuType.H100, GpuType.H200}


@pytest.mark.parametrize(("name", "rows"), [("trtllm_v0.17_perf_overview_throughput.csv", 373),
                                             ("trtllm_v1.0_perf_overview_throughput.csv", 210)])
def test_trtllm_throughput_tables(shared_data: Path, name: str, rows: int) -> None:
    r = _read(shared_data / "benchmarks" / name)
    assert len(r.points) == rows
    assert all(p.load is LoadKind.MAX and p.output_tok_s and p.engine is Engine.TRTLLM for p in r.points)
    assert {GpuType.H100, GpuType.H200} <= {p.gpu for p in r.points}


def test_seed_articles_usable_rows_and_named_problems(shared_data: Path) -> None:
    r = _read(shared_data / "benchmarks" / "seed_articles.csv")
    assert len(r.points) == 6  # the RTX 4090 rows name ISL/OSL; the others do not
    assert all(p.gpu is GpuType.RTX4090 and p.isl == 128 and p.osl == 100 for p in r.points)
    trt8 = next(p for p in r.points if p.engine is Engine.TRTLLM and p.concurrency == 8)
    assert trt8.itl_mean_ms == pytest.approx(1000 / 89.1)
    assert len(r.problems) == 6 and all("seed_articles.csv:" in m and "'workload'" in m for m in r.problems)


def test_operational_facts_is_not_a_benchmark(shared_data: Path) -> None:
    with pytest.raises(BenchmarkFormatError, match="unrecognised CSV"):
        _read(shared_data / "benchmarks" / "seed_operational_facts.csv")


def test_trtllm_bench_report_json_fixture() -> None:
    (p,) = _read(FIXTURES / "trtllm_bench_llama8b_h100_report.json").points
    assert (p.engine, p.gpu, p.tp, p.precision) == (Engine.TRTLLM, GpuType.H100, 1, Precision.FP8)
    assert p.load is LoadKind.MAX and p.output_tok_s == pytest.approx(21124.1)
    assert (p.isl, p.osl) == (128, 2048)
    assert p.tpot_p99_ms == pytest.approx(73.9) and p.ttft_p50_ms == pytest.approx(4800.3)


def test_aiperf_fixture() -> None:
    (p,) = _read(FIXTURES / "profile_export_aiperf.json", Metadata(engine=Engine.VLLM, tp=1,
                                                                       precision=Precision.BF16)).points
    assert p.gpu is GpuType.H100  # from the GPU telemetry section
    assert p.load is LoadKind.CONCURRENCY and p.concurrency == 8
    assert p.ttft_p99_ms == pytest.approx(120.5) and p.itl_mean_ms == pytest.approx(11.52)
    assert p.output_tok_s == pytest.approx(666.9) and (p.isl, p.osl) == (550, 128)


def test_aiperf_units_in_seconds_are_converted() -> None:
    d = json.loads((FIXTURES / "profile_export_aiperf.json").read_text())
    d["time_to_first_token"] = {"unit": "sec", "avg": 0.0613, "p50": 0.0579, "p99": 0.1205}
    meta = Metadata(engine=Engine.VLLM, tp=1, precision=Precision.BF16)
    (p,) = read_benchmark(json.dumps(d), "run/profile_export_aiperf.json", meta).points
    assert p.ttft_mean_ms == pytest.approx(61.3)


def test_genai_perf_csv_fixture_and_aliases() -> None:
    path = FIXTURES / "llama-3.1-8b-instruct-openai-chat-concurrency8" / "profile_export_genai_perf.csv"
    aliases = ModelAliases.build({"llama-3.1-8b": ["Llama-3.1-8B-Instruct", "LLaMA 3.1 8B"]})
    meta = Metadata(model="Llama-3.1-8B-Instruct", engine=Engine.TRTLLM, gpu=GpuType.H100, tp=1,
                    precision=Precision.BF16)
    (p,) = _read(path, meta, aliases).points
    assert p.model == "llama-3.1-8b"
    assert p.load is LoadKind.CONCURRENCY and p.concurrency == 8  # from the artifacts directory name
    assert p.ttft_mean_ms == pytest.approx(71.66) and p.ttft_p99_ms == pytest.approx(76.13)
    assert p.itl_p50_ms == pytest.approx(18.45)
    assert p.output_tok_s == pytest.approx(1367.84)  # "1,367.84"
    assert p.request_rps == pytest.approx(22.87)


def test_genai_perf_csv_without_load_in_the_name_is_refused() -> None:
    text = (FIXTURES / "llama-3.1-8b-instruct-openai-chat-concurrency8" / "profile_export_genai_perf.csv").read_text()
    meta = Metadata(model="m", engine=Engine.VLLM, gpu=GpuType.H100, tp=1, precision=Precision.BF16)
    with pytest.raises(BenchmarkFormatError, match="'concurrency' is missing"):
        read_benchmark(text, "profile_export_genai_perf.csv", meta)


# --- bad input: one line naming file, field and value ---------------------------------------------

VLLM_OK = {"model_id": "m", "backend": "vllm", "completed": 10, "total_input_tokens": 1000,
           "total_output_tokens": 500, "request_rate": 2.0, "max_concurrency": None,
           "request_throughput": 1.9, "output_throughput": 95.0, "mean_ttft_ms": 30.0,
           "median_ttft_ms": 29.0, "p99_ttft_ms": 50.0, "mean_itl_ms": 9.0}
META = Metadata(gpu=GpuType.H100, tp=1, precision=Precision.BF16)


def test_good_vllm_document_reads_as_rate_point() -> None:
    (p,) = read_benchmark(json.dumps(VLLM_OK), "x.json", META).points
    assert p.load is LoadKind.RATE and p.rate_rps == 2.0 and p.isl == 100 and p.osl == 50


def test_a_closed_loop_never_has_more_in_flight_than_it_sent() -> None:
    # `--max-concurrency 32 --num-prompts 16` ran 16 at once: read as 32, the fit saw throughput stop
    # rising and halved the engine's capacity (the demo's own sweep, issue 18)
    doc = {**VLLM_OK, "request_rate": "inf", "max_concurrency": 32, "num_prompts": 16, "completed": 16}
    (p,) = read_benchmark(json.dumps(doc), "x.json", META).points
    assert p.load is LoadKind.CONCURRENCY and p.concurrency == 16
    no_count = {k: v for k, v in doc.items() if k != "num_prompts"}
    assert read_benchmark(json.dumps(no_count), "x.json", META).points[0].concurrency == 16  # the completed
    full = {**doc, "num_prompts": 64, "completed": 64}
    assert read_benchmark(json.dumps(full), "x.json", META).points[0].concurrency == 32


def test_truncated_json() -> None:
    text = json.dumps(VLLM_OK)[:-20]
    with pytest.raises(BenchmarkFormatError, match=r"^run1\.json: invalid JSON at line 1 column \d+"):
        read_benchmark(text, "run1.json", META)


@pytest.mark.parametrize(("field", "value", "pattern"), [
    ("mean_ttft_ms", float("nan"), r"'mean_ttft_ms' must be finite, got nan"),
    ("output_throughput", -5.0, r"'output_throughput' must be non-negative, got -5.0"),
    ("output_throughput", None, r"'output_throughput' is missing"),
    ("completed", 0, r"'completed' must be positive, got 0"),
    ("request_throughput", "fast", r"'request_throughput' must be a number, got 'fast'"),
])
def test_bad_fields_are_named(field: str, value: object, pattern: str) -> None:
    doc = dict(VLLM_OK)
    doc[field] = value
    with pytest.raises(BenchmarkFormatError, match=r"^bad\.json: field " + pattern):
        read_benchmark(json.dumps(doc), "bad.json", META)


def test_unknown_gpu_row_is_reported_and_others_kept() -> None:
    header = "engine,version,method,model,gpu,precision,tp,isl,osl,total_output_throughput_tok_s\n"
    rows = ("tensorrt-llm,1.0,x,Llama 3.1 8B,H100,FP8,1,128,128,100\n"
            "tensorrt-llm,1.0,x,Llama 3.1 8B,Voodoo5 6000,FP8,1,128,128,100\n")
    r = read_benchmark(header + rows, "t.csv")
    assert len(r.points) == 1
    (problem,) = r.problems
    assert problem.startswith("t.csv:3: field 'gpu': unknown GPU 'Voodoo5 6000'")


def test_empty_and_unknown_documents() -> None:
    with pytest.raises(BenchmarkFormatError, match="empty file"):
        read_benchmark("  \n", "e.json")
    with pytest.raises(BenchmarkFormatError, match="unrecognised JSON benchmark format"):
        read_benchmark('{"hello": 1}', "h.json")
    with pytest.raises(BenchmarkFormatError, match="expected a JSON object"):
        read_benchmark("[1, 2]", "l.json")


def test_file_hints() -> None:
    h = file_hints("/d/vllm-inferencex/glm5_fp8_vllm_tp8_isl6144_osl128_conc8.json")
    assert (h.model, h.engine, h.tp, h.precision, h.isl, h.osl, h.concurrency) == (
        "glm5", Engine.VLLM, 8, Precision.FP8, 6144, 128, 8)
    amb = file_hints("vllm_vs_trtllm_h100_run.json")
    assert amb.engine is None and "engine" in amb.ambiguous
    assert math.isinf(file_hints("openai-infqps-concurrency8-x.json").rate_rps or 0)


def test_ambiguous_engine_in_name_is_an_error() -> None:
    doc = dict(VLLM_OK, backend="openai")
    with pytest.raises(BenchmarkFormatError, match=r"'engine' is missing \(the file name is ambiguous\)"):
        read_benchmark(json.dumps(doc), "vllm_vs_trtllm.json", META)
    (p,) = read_benchmark(json.dumps(doc), "vllm_vs_trtllm.json",
                          Metadata(engine=Engine.TRTLLM, gpu=GpuType.H100, tp=1, precision=Precision.BF16)).points
    assert p.engine is Engine.TRTLLM


def test_genai_perf_json_and_newer_aiperf_config_layouts() -> None:
    d = json.loads((FIXTURES / "profile_export_aiperf.json").read_text())
    meta = Metadata(engine=Engine.VLLM, tp=1, precision=Precision.BF16)
    genai = dict(d, input_config={"model": ["llama-3.1-8b-instruct"], "concurrency": 16})
    (p,) = read_benchmark(json.dumps(genai), "profile_export_genai_perf.json", meta).points
    assert p.model == "llama-3.1-8b-instruct" and p.concurrency == 16
    newer = dict(d, input_config={"models": {"items": [{"name": "org/Model-X"}]}, "loadgen": {"request_rate": 4}})
    (q,) = read_benchmark(json.dumps(newer), "profile_export_aiperf.json", meta).points
    assert q.model == "Model-X" and q.load is LoadKind.RATE and q.rate_rps == 4
