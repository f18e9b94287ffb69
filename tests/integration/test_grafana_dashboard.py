"""config/grafana/fleetplan-dashboard.json: a Grafana dashboard (JSON model) over the controller's
own metrics. It parses, takes its Prometheus data source from a template variable, uses only
Grafana's built-in panel types, reads only metrics controller/metrics.py exports, and every PromQL
expression parses (checked by `promtool check rules` on a rule file made of them)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.integration.promql_names import controller_metric_names, fleetplan_names

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "config" / "grafana" / "fleetplan-dashboard.json"
BUILTIN_PANELS = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "text", "state-timeline"}
DS_VAR = "${datasource}"
# What the dashboard must show (issue 9, item 6), by the metric that carries it.
REQUIRED = {
    "demand": "fleetplan_demand_rps",
    "capacity": "fleetplan_capacity_rps",
    "planned replicas": "fleetplan_planned_replicas",
    "running replicas": "fleetplan_running_replicas",
    "desired replicas": "fleetplan_desired_replicas",
    "predicted TTFT": "fleetplan_predicted_ttft_p99_seconds",
    "observed TTFT": "fleetplan_observed_ttft_p99_seconds",
    "predicted ITL": "fleetplan_predicted_itl_p99_seconds",
    "observed ITL": "fleetplan_observed_itl_p99_seconds",
    "unmet demand": "fleetplan_unmet_demand_rps",
    "plan $/h": "fleetplan_plan_usd_per_hour",
    "actions": "fleetplan_actions_total",
    "cycles": "fleetplan_cycles_total",
    "alerts active": "fleetplan_alerts_active",
    "stale models": "fleetplan_stale_models",
    "policy reloads": "fleetplan_policy_reloads_total",
    "last cycle age": "fleetplan_last_cycle_timestamp_seconds",
    "cost of uncertainty": "fleetplan_uncertainty_usd_per_hour",
    "requests that missed the SLO": "fleetplan_observed_slo_missed_ratio",
}


def _dashboard() -> dict[str, Any]:
    doc = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def _panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in doc["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows hold their panels
    return out


def _exprs(doc: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in _panels(doc) for t in p.get("targets", [])]


def test_dashboard_is_a_grafana_json_model() -> None:
    doc = _dashboard()
    assert doc["uid"] == "fleetplan-controller" and doc["title"]
    assert isinstance(doc["schemaVersion"], int) and doc["schemaVersion"] >= 36
    assert doc.get("id") is None, "an exported dashboard carries no database id"
    panels = _panels(doc)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert p["type"] in BUILTIN_PANELS, f"panel {p['title']!r}: {p['type']} is not a built-in panel"
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
    assert "__requires" not in doc or all(r["type"] != "panel" or r["id"] in BUILTIN_PANELS
                                           for r in doc["__requires"])


def test_prometheus_data_source_is_a_template_variable() -> None:
    doc = _dashboard()
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == {"type": "prometheus", "uid": DS_VAR}, v["name"]
    for p in _panels(doc):
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": DS_VAR}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == DS_VAR, p["title"]
    # no data source is pinned anywhere (e.g. a uid from the author's Grafana)
    uids = set(re.findall(r'"uid":\s*"([^"]*)"', DASHBOARD.read_text(encoding="utf-8")))
    assert uids <= {DS_VAR, "-- Grafana --", "fleetplan-controller"}, uids


def test_every_metric_the_dashboard_reads_is_exported_by_the_controller() -> None:
    doc = _dashboard()
    exported = controller_metric_names()
    used: set[str] = set()
    for expr in _exprs(doc):
        names = fleetplan_names(expr)
        assert names, f"expression reads no fleetplan_ metric: {expr}"
        used |= names
    for v in doc["templating"]["list"]:
        if v["type"] == "query":
            used |= fleetplan_names(v["definition"])
    unknown = used - exported
    assert not unknown, f"the dashboard reads metrics controller/metrics.py does not export: {sorted(unknown)}"
    missing = {what: name for what, name in REQUIRED.items() if name not in used}
    assert not missing, f"not on the dashboard: {missing}"


def test_every_promql_expression_parses(tmp_path: Path) -> None:
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    assert Path(promtool).exists(), "promtool ships with Debian's prometheus package (scripts/setup.sh)"
    doc = _dashboard()
    subst = {"$__rate_interval": "5m", "$job": "fleetplan", "$instance": "ctrl:9470", "$model": ".*"}
    rules = []
    for i, expr in enumerate(_exprs(doc)):
        for var, value in subst.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"unknown Grafana variable in {expr}"
        rules.append({"record": f"dashboard:expr{i}", "expr": expr})
    path = tmp_path / "dashboard-exprs.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}), encoding="utf-8")
    res = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(rules)} rules found" in res.stdout + res.stderr
