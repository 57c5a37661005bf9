"""Helpers for the deploy tests: the queries of the Grafana dashboard and the alert rules,
Grafana's variables filled in, the metric names an expression reads, Prometheus' binaries."""

import json
import re
import shutil
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "grafana" / "dllm-serve.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
             "offset", "bool", "inf", "nan"}


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of every panel."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(panel["title"], target["expr"]) for panel in panels for target in panel.get("targets", [])]


def dashboard_variable_queries() -> list[str]:
    """The PromQL inside the dashboard's ``label_values(EXPR, label)`` variables."""
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    return [re.fullmatch(r"label_values\((.+), *\w+\)", v["definition"]).group(1)
            for v in variables if v["type"] == "query"]


def alert_exprs() -> list[tuple[str, str]]:
    """(alert name, expr) of every rule."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(rule["alert"], rule["expr"]) for group in groups for rule in group["rules"]]


def fill_variables(expr: str, rate_interval: str = "1m") -> str:
    """The expression as Grafana sends it with every replica selected."""
    return expr.replace("$__rate_interval", rate_interval).replace("$replica", ".*")


def metric_names(expr: str) -> set[str]:
    """Names of the series an expression selects (not functions, keywords or label names)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)            # strings
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)         # matchers, ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", text)
    return {n for n in names if n not in _KEYWORDS and not re.fullmatch(r"\d.*|e\d+", n)}


def binary(name: str) -> str:
    """Path of ``prometheus`` or ``promtool`` (Debian's package, installed by .ci/run)."""
    path = shutil.which(name)
    assert path, f"{name} is not installed: apt-get install -y prometheus (what .ci/run does)"
    return path
