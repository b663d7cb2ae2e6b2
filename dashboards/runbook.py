"""The on-call runbook as a Grafana dashboard (uid `lagscope-runbook`): one text panel per
alert, the Grafana rules on the jobs (`alerts.py`) and the Prometheus rules on the
pipeline (`prometheus_rules.py`), each saying when it fires, what it means, what to do
and which panels to read, written from the rules' own definitions. Every rule's
`runbook_url` opens its panel (`viewPanel`), so the link an alert carries is served by the
same Grafana that shows the data, wherever the team runs it.
"""

from __future__ import annotations

import zlib

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import text
from grafana_foundation_sdk.models import text as text_model

from lagscope.dashboards.panels import BuiltDashboard

RUNBOOK_UID = "lagscope-runbook"
RUNBOOK_SLUG = "lagscope-runbook"


def panel_id(anchor: str) -> int:
    """The runbook panel of an alert, by a stable number made from its name: the rules
    link to it before (and without) the dashboard being built.

    >>> panel_id("LagscopeWorkerDown") == panel_id("LagscopeWorkerDown") > 0
    True
    """
    return zlib.crc32(anchor.encode()) % 900_000 + 100_000


def runbook_url(anchor: str, grafana_url: str = "") -> str:
    """The alert's runbook panel in Grafana at `grafana_url` ("" : a link relative to the
    Grafana that shows the alert).

    >>> runbook_url("lagscope-job-silent", "https://grafana.example.com/")
    'https://grafana.example.com/d/lagscope-runbook/lagscope-runbook?viewPanel=panel-141115'
    """
    base = grafana_url.rstrip("/")
    return f"{base}/d/{RUNBOOK_UID}/{RUNBOOK_SLUG}?viewPanel=panel-{panel_id(anchor)}"


def _panel(anchor: str, title: str, body: str) -> text.Panel:
    return (
        text.Panel()
        .id(panel_id(anchor))
        .title(title)
        .mode(text_model.TextMode.MARKDOWN)
        .content(body)
        .span(24)
        .height(9)
    )


def _steps(actions: tuple[str, ...]) -> str:
    return "\n".join(f"{n}. {action}" for n, action in enumerate(actions, 1))


def runbook() -> BuiltDashboard:
    from lagscope.dashboards.alerts import DASHBOARD_TITLES, RULES
    from lagscope.dashboards.prometheus_rules import ALERTS

    builder = (
        dash.Dashboard("lagscope: runbook")
        .uid(RUNBOOK_UID)
        .description("What each lagscope alert means and what to do, one panel per alert.")
        .tags(["lagscope", "runbook"])
        .with_row(dash.Row("Jobs (Grafana alert rules, on the store)"))
    )
    for rule in RULES:
        panels = ", then ".join(f"'{panel}'" for panel in rule.next_panels)
        body = (
            f"**Fires when** {rule.fires_when} ({rule.severity}).\n\n"
            f"**What it means.** {rule.description}\n\n"
            f"**Look at** '{DASHBOARD_TITLES[rule.dashboard_uid]}': {panels}.\n\n"
            f"**Do**\n\n{_steps(rule.actions)}"
        )
        builder = builder.with_panel(_panel(rule.uid, rule.title, body))
    builder = builder.with_row(dash.Row("Pipeline (Prometheus rules, on the components)"))
    for alert in ALERTS:
        body = (
            f"**Fires when** `{alert.expr}` holds for {alert.for_} ({alert.severity}).\n\n"
            f"**What it means.** {alert.description}\n\n**Do**\n\n{_steps(alert.actions)}"
        )
        builder = builder.with_panel(_panel(alert.anchor, alert.name, body))
    return BuiltDashboard(RUNBOOK_UID, builder.build())
