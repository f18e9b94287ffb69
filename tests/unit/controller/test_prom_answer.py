"""Prometheus answers of the wrong shape are Prometheus errors naming the query and what was wrong
(controller/prom_answer.py), through the client and the Observer (httpx mock transport)."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest

from fleetplan.controller.observe import Observer, PromClient, PrometheusError
from fleetplan.controller.prom_answer import data_of, matrix_of, scalar_of, vector_of

W = "prometheus at http://p:9090, query rate 'x'"


def _vector(result: Any) -> dict[str, Any]:
    return {"resultType": "vector", "result": result}


@pytest.mark.parametrize(("body", "what"), [
    ({"status": "success", "data": None}, "data null"),
    ([], "a JSON list"),
    ("ok", "a JSON str"),
    ({"status": "error", "errorType": "bad_data", "error": "parse error"}, "bad_data: parse error"),
    ({"status": "success", "data": []}, "data list"),
])
def test_a_body_without_a_data_object_is_an_error(body: Any, what: str) -> None:
    with pytest.raises(PrometheusError, match="query rate 'x'") as exc:
        data_of(body, W)
    assert what in str(exc.value)


@pytest.mark.parametrize(("data", "what"), [
    ({"resultType": "vector"}, "data has no result"),
    ({"result": []}, "resultType None"),
    ({"resultType": "matrix", "result": []}, "resultType 'matrix', expected vector or scalar"),
    (_vector({"a": 1}), "result is dict, expected a list"),
    (_vector(None), "result is null"),
    (_vector([1]), r"result\[0\] is int"),
    (_vector([{"metric": {}, "value": "1"}]), r"result\[0\].value is str"),
    (_vector([{"metric": {}, "value": [1.0]}]), r"result\[0\].value is list"),
    (_vector([{"metric": {}, "value": ["1", "2"]}]), "timestamp '1'"),
    (_vector([{"metric": {}, "value": [1.0, 2]}]), "value 2, expected a string"),
    (_vector([{"metric": {"model": 3}, "value": [1.0, "2"]}]), r"result\[0\].metric"),
    ({"resultType": "scalar", "result": None}, "the scalar is null"),
])
def test_an_instant_answer_of_the_wrong_shape_is_an_error(data: dict[str, Any], what: str) -> None:
    with pytest.raises(PrometheusError, match=what) as exc:
        vector_of(data, W)
    assert str(exc.value).startswith(W)


def test_well_formed_answers_are_read() -> None:
    samples = vector_of(_vector([{"metric": {"model": "m"}, "value": [1.0, "2.5"]},
                                 {"value": [1.0, "NaN"]}, {"metric": {}, "value": [1, "oops"]}]), W)
    assert samples[0].labels == {"model": "m"} and samples[0].value == 2.5
    assert math.isnan(samples[1].value) and math.isnan(samples[2].value)  # as Prometheus writes NaN
    assert vector_of({"resultType": "scalar", "result": [5.0, "7"]}, W)[0].value == 7.0
    assert scalar_of({"resultType": "scalar", "result": [5.0, "5"]}, W) == (5.0, 5.0)
    series = matrix_of({"resultType": "matrix", "result": [{"metric": {"model": "m"},
                                                             "values": [[1, "1"], [2, "3"]]}]}, W)
    assert series[0].points == ((1.0, 1.0), (2.0, 3.0))
    with pytest.raises(PrometheusError, match=r"result\[0\].values\[1\]"):
        matrix_of({"resultType": "matrix", "result": [{"values": [[1, "1"], [2]]}]}, W)
    with pytest.raises(PrometheusError, match="values is dict"):
        matrix_of({"resultType": "matrix", "result": [{"values": {}}]}, W)


def _client(answer: Any, for_query: str, path: str = "/api/v1/query") -> PromClient:
    """A client whose Prometheus answers `answer` to queries on `path` containing `for_query`,
    healthy (its time, empty vectors and matrices) otherwise."""

    def handler(request: httpx.Request) -> httpx.Response:
        q = request.url.params.get("query", "")
        if for_query in q and request.url.path == path:
            return httpx.Response(200, content=json.dumps(answer).encode())
        if q == "time()":
            data: dict[str, Any] = {"resultType": "scalar", "result": [100.0, "100"]}
        elif request.url.path.endswith("query_range"):
            data = {"resultType": "matrix", "result": []}
        else:
            data = _vector([])
        return httpx.Response(200, json={"status": "success", "data": data})

    client = PromClient("http://p:9090")
    client._client = httpx.AsyncClient(base_url="http://p:9090", transport=httpx.MockTransport(handler))
    return client


@pytest.mark.parametrize("answer", [{"status": "success", "data": None}, [],
                                    {"status": "success", "data": _vector([{"value": "x"}])}])
async def test_the_observer_fails_static_on_a_wrong_shape_naming_the_query(answer: Any) -> None:
    client = _client(answer, for_query="histogram_quantile(0.99")
    try:
        readings = await Observer(client).fetch()
        assert readings.error is not None and readings.results == {}
        assert "prometheus at http://p:9090, query ttft_p99" in readings.error \
            or "query itl_p99" in readings.error, readings.error
        snap = await Observer(client).snapshot(["m"])
        assert not snap.prometheus_ok and snap.models["m"].stale
        assert any("fail static: prometheus at http://p:9090, query" in a for a in snap.alerts), snap.alerts
    finally:
        await client.aclose()


async def test_a_wrong_shaped_history_or_time_is_named_too() -> None:
    client = _client({"status": "success", "data": {"resultType": "matrix"}}, "request_success", "/api/v1/query_range")
    try:
        readings = await Observer(client).fetch()
        assert readings.error is not None and "query history" in readings.error, readings.error
    finally:
        await client.aclose()
    client = _client({"status": "success", "data": _vector([])}, "time()")
    try:
        readings = await Observer(client).fetch()
        assert readings.error is not None and "query clock 'time()'" in readings.error, readings.error
        assert "resultType 'vector', expected scalar" in readings.error
    finally:
        await client.aclose()
