"""What every lagscope dashboard is built from (grafana-foundation-sdk builders, ClickHouse
SQL): the built dashboard with the columns each query must return (`Expect`, `Collector`),
the dashboards' variables and the SQL that reads them safely, thresholds, and the panels
more than one dashboard shows.

Every SQL query is declared with the columns its panel needs (`Expect`); the tests render
each query with Grafana's and the ClickHouse plugin's expansion (`macros.py`), run it
against a store filled by the embedded pipeline and check those columns. Reads follow the
schema's rules: replacing tables with `FINAL`, the minute rollup summed by key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models import dashboard as model

from lagscope.dashboards.clickhouse_query import (
    DATASOURCE_UID,
    DATASOURCE_VARIABLE,
    PLUGIN_ID,
    ClickHouseQueryBuilder,
    datasource_ref,
    register_clickhouse_query,
)

ColumnKind = Literal["time", "number", "string"]


@dataclass(frozen=True)
class Expect:
    """The result a query must have for its panel: columns (name -> kind) in any order;
    `may_be_empty` for panels whose data a healthy store may lack (e.g. no dead letters)."""

    columns: dict[str, ColumnKind]
    may_be_empty: bool = False


@dataclass
class BuiltDashboard:
    uid: str
    dashboard: model.Dashboard
    #: (panel title or "annotation: NAME", refId) -> what the query must return.
    expectations: dict[tuple[str, str], Expect] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The dashboard as Grafana's JSON model (plain dicts and lists), in the SDK's
        canonical form: read back through the SDK's `Dashboard` model once, so the file is
        a fixed point of that model (it fills defaults such as an empty `custom` config)."""
        return sdk_round_trip(_encode(self.dashboard))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def _encode(value: object) -> Any:
    return json.loads(json.dumps(value, cls=JSONEncoder))


def sdk_round_trip(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` decoded by the SDK's dashboard model and encoded again.

    Annotation queries are kept as they are: the SDK models annotation targets of Grafana's
    built-in source only and would drop the SQL (`ClickHouseAnnotationTarget`); the tests
    check those through `ClickHouseQuery` instead.
    """
    register_default_plugins()
    register_clickhouse_query()
    decoded = _encode(model.Dashboard.from_json(raw))
    if "annotations" in raw:
        decoded["annotations"] = raw["annotations"]
    return decoded


class Collector:
    """Keeps each query's expectation next to the panel that runs it."""

    def __init__(self) -> None:
        self.expectations: dict[tuple[str, str], Expect] = {}

    def query(
        self,
        panel_title: str,
        sql: str,
        expect: Expect,
        *,
        time_series: bool,
        ref_id: str = "A",
    ) -> ClickHouseQueryBuilder:
        key = (panel_title, ref_id)
        if key in self.expectations:
            raise ValueError(f"two queries {ref_id} in panel {panel_title!r}")
        self.expectations[key] = expect
        query = ClickHouseQueryBuilder(dedent_sql(sql)).ref_id(ref_id)
        return query.time_series() if time_series else query.table()


def dedent_sql(sql: str) -> str:
    return "\n".join(line.strip() for line in sql.strip().splitlines())


# -- shared pieces -----------------------------------------------------------------------


def selected(variable: str) -> str:
    """The values selected in a dashboard variable, as a ClickHouse Array(String).

    No variable is pasted into SQL as is: the ClickHouse plugin inserts a value raw (and
    multi-values only quoted), and Grafana's `sqlstring` format only doubles quotes, while
    ClickHouse string literals also honour backslash escapes (`\\'` ends no string), so a
    crafted job id could break out of the literal. Grafana's `queryparam` format writes
    `var-NAME=VALUE&var-NAME=VALUE...` with every value percent-encoded down to RFC 3986's
    unreserved characters: no quote, backslash, comment or semicolon can reach the SQL, and
    the SQL decodes the values itself.
    """
    prefix = len(f"var-{variable}=")
    return f"arrayMap(v -> decodeURLComponent(substring(v, {prefix + 1})), {_encoded(variable)})"


def _encoded(variable: str) -> str:
    """The variable's `queryparam` parts, still percent-encoded: `['var-job=a%27b', ...]`."""
    return f"splitByChar('&', '${{{variable}:queryparam}}')"


def any_selected(variable: str, value: str) -> str:
    """SQL that is true when `value` is among a multi-value variable's selection. With
    "All" selected, Grafana's `queryparam` format writes `$__all` (the URL state), not
    every option: that matches everything, as "All" means. (Compared still encoded: a
    `$__` in the SQL would be taken for a plugin macro.)"""
    all_selected = f"has({_encoded(variable)}, 'var-{variable}=%24__all')"
    return f"({all_selected} OR has({selected(variable)}, {value}))"


def one_selected(variable: str) -> str:
    """The (single) value selected in a dashboard variable, as a ClickHouse String."""
    return f"{selected(variable)}[1]"


ONE_ATTEMPT = (
    f"job_id = {one_selected('job')} AND attempt = toUInt32OrNull({one_selected('attempt')})"
)
#: The selected job attempt's rows in the dashboard's time range.
IN_RANGE = f"{ONE_ATTEMPT} AND $__timeFilter(ts)"
#: Job attempts all of whose ranks said they ended (their monitors closed): done, so
#: neither silent nor still losing time (to an episode left open at their last step, a
#: slowdown, a low MFU, a rank missing from their last steps). Every alert rule about a
#: job leaves them; the fleet and the job overview say "ended".
ENDED_JOBS = "(SELECT job_id, attempt FROM jobs FINAL WHERE ended_at IS NOT NULL)"
#: The job overview's uid: the fleet dashboards and the alerts link to it, and its worker
#: matrices link to itself.
JOB_OVERVIEW_UID = "lagscope-job"
SELECTED_ATTEMPTS = (
    f"{any_selected('job', 'job_id')} AND {any_selected('attempt', 'toString(attempt)')}"
)


def datasource_variable() -> dash.DatasourceVariable:
    """The ClickHouse data source every query of the dashboard reads (`${datasource}`),
    starting on the one lagscope provisions."""
    return (
        dash.DatasourceVariable(DATASOURCE_VARIABLE)
        .label("ClickHouse")
        .type(PLUGIN_ID)
        .current(
            model.VariableOption(selected=True, text="lagscope ClickHouse", value=DATASOURCE_UID)
        )
    )


def job_variable(*, multi: bool) -> dash.QueryVariable:
    variable = (
        dash.QueryVariable("job")
        .label("job")
        .datasource(datasource_ref())
        .query("SELECT DISTINCT job_id FROM jobs FINAL ORDER BY job_id")
        .refresh(model.VariableRefresh.ON_DASHBOARD_LOAD)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
    )
    return variable.multi(True).include_all(True) if multi else variable


def attempt_variable(*, multi: bool) -> dash.QueryVariable:
    where = any_selected("job", "job_id") if multi else f"job_id = {one_selected('job')}"
    variable = (
        dash.QueryVariable("attempt")
        .label("attempt")
        .datasource(datasource_ref())
        .query(f"SELECT DISTINCT attempt FROM jobs FINAL WHERE {where} ORDER BY attempt DESC")
        .refresh(model.VariableRefresh.ON_DASHBOARD_LOAD)
        .sort(model.VariableSort.NUMERICAL_DESC)
    )
    return variable.multi(True).include_all(True) if multi else variable


def traffic_light(orange: float, red: float) -> dash.ThresholdsConfig:
    """Green below `orange`, orange from it, red from `red`."""
    return (
        dash.ThresholdsConfig()
        .mode(model.ThresholdsMode.ABSOLUTE)
        .steps(
            [
                model.Threshold(value=None, color="green"),
                model.Threshold(value=orange, color="orange"),
                model.Threshold(value=red, color="red"),
            ]
        )
    )


def slowdown_thresholds() -> dash.ThresholdsConfig:
    return traffic_light(1.05, 1.2)


class BuiltTarget(cogbuilder.Builder[model.AnnotationTarget]):
    """Wraps an already built object where the SDK wants a builder."""

    def __init__(self, built: model.AnnotationTarget) -> None:
        self._built = built

    def build(self) -> model.AnnotationTarget:
        return self._built
