"""Prometheus HTTP API answers checked for their shape before they are read (no I/O here).

An answer is `{"status": "success", "data": {"resultType": ..., "result": ...}}`
(https://prometheus.io/docs/prometheus/latest/querying/api/): an instant query's vector result is
a list of `{"metric": {...}, "value": [ts, "v"]}`, a scalar `[ts, "v"]`, a range query's matrix a
list of `{"metric": {...}, "values": [[ts, "v"], ...]}`. Anything else (valid JSON of another
shape: `{"status": "success", "data": null}`, `[]`, a result that is not a list, a sample that is
not a pair) is a PrometheusError naming the query and what was wrong, never an AttributeError or a
TypeError out of the observation: the cycle fails static on it like on an unreachable Prometheus.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fleetplan.planner.observation import Sample, Series

__all__ = ["PrometheusError", "data_of", "matrix_of", "scalar_of", "short", "vector_of"]


class PrometheusError(RuntimeError):
    """Prometheus unreachable, late, or answered an error or an answer of the wrong shape."""


def short(expr: str, limit: int = 80) -> str:
    """A query as an alert quotes it: its first `limit` characters."""
    return expr if len(expr) <= limit else expr[: limit - 3] + "..."


def _kind(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def data_of(body: Any, where: str) -> Mapping[str, Any]:
    """The `data` object of a decoded answer; `where` names the server and the query for errors."""
    if not isinstance(body, Mapping):
        raise PrometheusError(f"{where}: answered a JSON {_kind(body)}, expected an object with status and data")
    if body.get("status") != "success":
        raise PrometheusError(f"{where}: {body.get('errorType')}: {body.get('error')}")
    data = body.get("data")
    if not isinstance(data, Mapping):
        raise PrometheusError(f"{where}: answered status success with data {_kind(data)}, expected an object")
    return data


def _value(pair: Any, where: str, what: str) -> tuple[float, float]:
    """A `[ts, "v"]` pair: the time as a float, the value (NaN where it is not a number)."""
    if not isinstance(pair, list | tuple) or len(pair) != 2:
        raise PrometheusError(f"{where}: {what} is {_kind(pair)} {str(pair)[:40]}, expected [timestamp, \"value\"]")
    ts, text = pair
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise PrometheusError(f"{where}: {what} has timestamp {ts!r}, expected a number")
    if not isinstance(text, str):
        raise PrometheusError(f"{where}: {what} has value {text!r}, expected a string")
    try:
        return float(ts), float(text)
    except ValueError:
        return float(ts), math.nan


def _labels(item: Mapping[str, Any], where: str, i: int) -> Mapping[str, str]:
    labels = item.get("metric", {})
    if not isinstance(labels, Mapping) or not all(isinstance(v, str) for v in labels.values()):
        raise PrometheusError(f"{where}: result[{i}].metric is {str(labels)[:60]}, expected an object of strings")
    return labels


def _result(data: Mapping[str, Any], where: str, kinds: tuple[str, ...]) -> tuple[str, Any]:
    kind = data.get("resultType")
    if kind not in kinds:
        raise PrometheusError(f"{where}: resultType {kind!r}, expected {' or '.join(kinds)}")
    if "result" not in data:
        raise PrometheusError(f"{where}: data has no result")
    return kind, data["result"]


def _items(result: Any, where: str) -> list[Mapping[str, Any]]:
    if not isinstance(result, list):
        raise PrometheusError(f"{where}: result is {_kind(result)}, expected a list")
    for i, item in enumerate(result):
        if not isinstance(item, Mapping):
            raise PrometheusError(f"{where}: result[{i}] is {_kind(item)}, expected an object")
    return result


def vector_of(data: Mapping[str, Any], where: str) -> list[Sample]:
    """An instant query's samples (a vector, or a scalar as one sample without labels)."""
    kind, result = _result(data, where, ("vector", "scalar"))
    if kind == "scalar":
        return [Sample({}, _value(result, where, "the scalar")[1])]
    return [Sample(_labels(item, where, i), _value(item.get("value"), where, f"result[{i}].value")[1])
            for i, item in enumerate(_items(result, where))]


def scalar_of(data: Mapping[str, Any], where: str) -> tuple[float, float]:
    """A scalar answer's (evaluation time, value), e.g. of `time()`."""
    _, result = _result(data, where, ("scalar",))
    return _value(result, where, "the scalar")


def matrix_of(data: Mapping[str, Any], where: str) -> list[Series]:
    """A range query's series."""
    _, result = _result(data, where, ("matrix",))
    out = []
    for i, item in enumerate(_items(result, where)):
        values = item.get("values", [])
        if not isinstance(values, list):
            raise PrometheusError(f"{where}: result[{i}].values is {_kind(values)}, expected a list")
        points = tuple(_value(v, where, f"result[{i}].values[{j}]") for j, v in enumerate(values))
        out.append(Series(_labels(item, where, i), points))
    return out
