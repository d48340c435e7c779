"""The provisioned Grafana dashboard's queries, parsed as PromQL (promql-parser, a real parser).

Grafana's own variables are not PromQL: each is replaced by what Grafana would send before
parsing (`$model_name` by the model's name, the intervals by durations).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import promql_parser as pp

from tests.helpers import REPO

DEPLOY = REPO / "deploy"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
PANEL_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
_LABEL_VALUES = re.compile(r"^label_values\((?:(.+),\s*)?(\w+)\)$")


def load(path: Path = DASHBOARDS / "tokenline.json") -> dict:
    return json.loads(path.read_text())


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel that draws something, those inside collapsed rows too."""
    for p in dashboard["panels"]:
        if p["type"] == "row":
            yield from panels({"panels": p.get("panels", [])})
        else:
            yield p


def expressions(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable's selector."""
    for p in panels(dashboard):
        for t in p["targets"]:
            yield f"panel {p['title']!r} {t['refId']}", t["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = _LABEL_VALUES.match(query.strip())
        assert m, f"variable {var['name']}: not a label_values() query: {query}"
        if m.group(1):
            yield f"variable {var['name']}", m.group(1)


@dataclass
class Query:
    """What one expression asks of /metrics: selectors (name, {label: matcher}), grouping."""

    selectors: list[tuple[str, list[pp.Matcher]]] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)


def parse(expr: str, model_name: str = "m") -> Query:
    for var, value in PANEL_VARIABLES.items():
        expr = expr.replace(var, value)
    # Grafana escapes a regex variable's value for a PromQL string, as here
    expr = expr.replace("$model_name", re.escape(model_name).replace("\\", "\\\\"))
    assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
    q = Query()

    def visit(node) -> None:
        if isinstance(node, pp.VectorSelector):
            q.selectors.append((node.name, list(node.matchers.matchers)))
        elif isinstance(node, pp.AggregateExpr) and node.modifier is not None:
            q.grouping.update(node.modifier.labels)

    pp.walk(pp.parse(expr), visit)
    return q


def matches(matcher: pp.Matcher, labels: dict[str, str]) -> bool:
    """Prometheus's rule: a label a series lacks has the empty value; regexes match whole."""
    value = labels.get(matcher.name, "")
    if matcher.op in (pp.MatchOp.Re, pp.MatchOp.NotRe):
        hit = re.fullmatch(matcher.value, value) is not None
    else:
        hit = value == matcher.value
    return hit if matcher.op in (pp.MatchOp.Equal, pp.MatchOp.Re) else not hit
