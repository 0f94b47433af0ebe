"""The operator kit in deploy/ only names metrics that kiln really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

import kiln
import kiln.demo
from kiln.api.metrics import ApiMetrics
from kiln.config import Settings

ROOT = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"\bkiln_[a-z_]+")
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def _base(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def _alert_exprs() -> list[str]:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/kiln-alerts.yml").read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((ROOT / "deploy/grafana/kiln-dashboard.json").read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]


async def test_alert_rules_and_dashboard_use_exported_metric_names(settings: Settings) -> None:
    # Given an app with one task, scraped as Prometheus would
    app = kiln.App(settings=settings)
    kiln.demo.register(app)
    async with app:
        await app.submit("image.generate", {"prompt": "a fox"})
        exported = ApiMetrics().render
        text = (await exported(app.engine)).decode()
    api_names = {_base(m) for m in METRIC.findall(text)}
    process_names = set(METRIC.findall((ROOT / "src/kiln/process_metrics.py").read_text()))

    # When every expression of the alert rules and the dashboard is read
    exprs = _alert_exprs() + _dashboard_exprs()
    used = {_base(name) for expr in exprs for name in METRIC.findall(expr)}

    # Then each metric it names is exported by the API or by a worker/supervisor process
    assert used, "the operator kit names no metric"
    assert used - api_names - process_names == set()
    assert len(_alert_exprs()) >= 5
