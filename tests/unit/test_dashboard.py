"""deploy/grafana and deploy/prometheus.yaml: every file parses, and the dashboard draws, per
model, what an operator looks at. That its metric names are served is tests/e2e's check
(test_metrics_and_logs.py::test_every_dashboard_query_finds_served_series)."""

from __future__ import annotations

import re

import yaml

from tests import dashboard as dash

GRAFANA = dash.DEPLOY / "grafana"
LATENCIES = ("time_to_first_token_seconds", "inter_token_latency_seconds",
             "e2e_request_latency_seconds")


def _datasource() -> dict:
    config = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())
    (source,) = config["datasources"]
    return source


def test_provisioning_files_parse_and_name_the_prometheus_datasource():
    source = _datasource()
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert source["uid"]
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/tokenline.yaml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    scrape = yaml.safe_load((dash.DEPLOY / "prometheus.yaml").read_text())
    assert scrape["scrape_configs"]


def test_dashboard_parses_and_every_query_is_promql_on_the_provisioned_datasource():
    files = sorted(dash.DASHBOARDS.glob("*.json"))
    assert [f.name for f in files] == ["tokenline.json"]
    board = dash.load(files[0])
    assert board["uid"] and board["title"]
    uid = _datasource()["uid"]
    drawn = list(dash.panels(board))
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for p in drawn:
        assert p["datasource"]["uid"] == uid, p["title"]
        assert p["targets"] and all(t["datasource"]["uid"] == uid for t in p["targets"])
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]), p["title"]
    (var,) = board["templating"]["list"]
    assert var["name"] == "model_name" and var["datasource"]["uid"] == uid
    exprs = list(dash.expressions(board))
    assert len(exprs) > len(drawn)  # the variable's query too
    for where, expr in exprs:
        q = dash.parse(expr)  # raises on anything that is not PromQL
        assert q.selectors, where
        for name, _ in q.selectors:
            assert name and name.startswith("tokenline:"), f"{where}: {name}"


def test_every_panel_is_per_model():
    for where, expr in dash.expressions(dash.load()):
        if where.startswith("variable"):
            continue
        q = dash.parse(expr, model_name="SmolLM2")
        assert "model_name" in q.grouping, f"{where}: not split by model_name"
        for name, matchers in q.selectors:
            model = [m for m in matchers if m.name == "model_name"]
            assert model and model[0].value == "SmolLM2", f"{where}: {name} not filtered"


def test_dashboard_draws_what_an_operator_watches():
    exprs = [expr for _, expr in dash.expressions(dash.load())]
    names = {name for e in exprs for name, _ in dash.parse(e).selectors}
    assert {f"tokenline:{n}" for n in (
        "request_success_total", "num_requests_running", "num_requests_waiting",
        "kv_cache_usage_perc", "num_retractions_total", "prefix_cache_hits_total",
        "prefix_cache_queries_total", "prompt_tokens_total", "generation_tokens_total",
        "scheduler_info",  # the quantization in use
        "router_decisions_total", "router_predicted_cached_tokens_total",
        "router_cached_tokens_total",
        "nats_reconnects_total", "requests_resumed_total", "nats_rtt_seconds",  # NATS
    )} <= names
    for latency in LATENCIES:
        quantiles = {float(m.group(1)) for e in exprs if f"tokenline:{latency}_bucket" in e
                     for m in [re.match(r"histogram_quantile\(([\d.]+),", e)] if m}
        assert quantiles == {0.5, 0.9, 0.99}, latency
    reasons = {m.value for e in exprs for name, ms in dash.parse(e).selectors
               if name == "tokenline:request_success_total" for m in ms
               if m.name == "finished_reason"}
    assert reasons == {"stop|length", "abort", "error"}  # success, abort, error counts
