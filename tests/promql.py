"""The PromQL that deploy/ holds, ready to run: dashboard targets with Grafana's variables filled in,
and prometheus-adapter rules with their templates expanded (shared by test_deploy.py, which parses
them with promtool, and test_prometheus_live.py, which evaluates them in a real Prometheus).

    from promql import dashboard_queries, fill_grafana_variables
    for title, ref_id, expr in dashboard_queries(dashboard):
        query = fill_grafana_variables(expr, rate_interval="1m", range_="1h", model_name=".*")
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "specserve.json"
K8S = ROOT / "deploy" / "k8s"


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dashboard: dict) -> list[dict]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))   # collapsed rows nest their panels
    return panels


def dashboard_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every target of every panel."""
    return [(p["title"], t["refId"], t["expr"]) for p in dashboard_panels(dashboard) for t in p.get("targets", [])]


def dashboard_exprs(dashboard: dict) -> list[str]:
    return [expr for _, _, expr in dashboard_queries(dashboard)]


def fill_grafana_variables(expr: str, rate_interval: str = "1m", range_: str = "1h", interval: str = "15s",
                           model_name: str = ".*") -> str:
    """`expr` as Grafana sends it to Prometheus, for the given variable values. Raises ValueError on a
    variable this does not know (so a new one in the dashboard is noticed, not sent as is)."""
    values = {"__rate_interval": rate_interval, "__range": range_, "__interval": interval,
              "model_name": model_name}

    def substitute(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise ValueError(f"unknown Grafana variable ${name} in {expr!r}")
        return values[name]

    # $name and ${name}; longest names first is implicit: \w+ is greedy ($__rate_interval, not $__r...)
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", substitute, expr)


def template_variable_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(variable name, query) of the dashboard's query variables (label_values(...))."""
    out = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            out.append((variable["name"], query))
    return out


# ---------------------------------------------------------------------------- HPA / prometheus-adapter

def k8s_document(kind: str, name: str) -> dict:
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == kind and doc["metadata"]["name"] == name:
                return doc
    raise KeyError(f"{kind}/{name}")


def adapter_rules() -> list[dict]:
    return yaml.safe_load(k8s_document("ConfigMap", "prometheus-adapter")["data"]["config.yaml"])["rules"]


def hpa_metric_names() -> list[str]:
    """Names of the custom (Pods / Object) metrics the HPA reads through the adapter."""
    names = []
    for metric in k8s_document("HorizontalPodAutoscaler", "specserve")["spec"]["metrics"]:
        kind = metric["type"]
        if kind in ("Pods", "Object"):
            names.append(metric[kind.lower()]["metric"]["name"])
    return names


def expand_adapter_query(template: str, series: str, matchers: dict[str, str | list[str]],
                         group_by: list[str]) -> str:
    """A metricsQuery as prometheus-adapter runs it for one request: <<.Series>> is the matched series
    name, <<.LabelMatchers>> the resource matchers (a list of objects becomes label=~"a|b", as the
    adapter writes it for several pods), <<.GroupBy>> the resource labels, comma-separated."""
    rendered = []
    for label, value in matchers.items():
        if isinstance(value, list):
            rendered.append(f'{label}=~"{"|".join(value)}"')
        else:
            rendered.append(f'{label}="{value}"')
    expanded = (template.replace("<<.Series>>", series).replace("<<.LabelMatchers>>", ",".join(rendered))
                .replace("<<.GroupBy>>", ",".join(group_by)))
    if "<<" in expanded:
        raise ValueError(f"unexpanded adapter template in {expanded!r}")
    return expanded
