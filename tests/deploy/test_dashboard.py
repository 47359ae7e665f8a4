"""The Grafana dashboard shipped in deploy/grafana loads as Grafana reads it: valid JSON
of the dashboard model, panels on the 24-column grid, every query valid PromQL on the
datasource variable. That it reads only metrics the services export is checked against
a running cluster (tests/integration/test_up_e2e.py)."""

from __future__ import annotations

from tests.deploy.dashboard import expressions, load, parse, reads


def test_panels_are_unique_and_on_the_grid() -> None:
    dashboard = load()
    assert dashboard["uid"] == "globalkv"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        assert grid["h"] > 0, panel["title"]
        assert grid["y"] >= 0, panel["title"]


def test_every_query_is_promql_on_the_chosen_datasource() -> None:
    dashboard = load()
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job"} <= variables
    queries = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert queries
    for panel in queries:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            metrics = {read.metric for read in reads(parse(target["expr"]))}
            assert metrics, target["expr"]
            assert all(m.startswith("globalkv_") for m in metrics), target["expr"]


def test_every_query_filters_by_the_job_variable() -> None:
    for expr in expressions(load()):
        assert expr.count('{job=~"$job"}') == expr.count("globalkv_"), expr
