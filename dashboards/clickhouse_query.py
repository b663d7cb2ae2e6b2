"""A typed query of the Grafana ClickHouse data source (plugin `grafana-clickhouse-datasource`)
for grafana-foundation-sdk, which ships query models for other data sources only.

The fields are the plugin's SQL-editor query model: `rawSql`, `editorType: "sql"`,
`queryType` (how the editor presents results: "table", "timeSeries", "logs", "traces"),
`format` (how the plugin's backend shapes the frame: 0 = time series, i.e. a `time`
column and long frames pivoted to wide with string columns as labels; 1 = table, as is),
and the data source reference. `register_clickhouse_query()` teaches the SDK's runtime to
decode these queries when it reads a dashboard (`Dashboard.from_json`), so a round trip
keeps them typed instead of as an unknown bag.
"""

from __future__ import annotations

import enum
from typing import Any, Self

from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import runtime as cogruntime
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.models import dashboard

PLUGIN_ID = "grafana-clickhouse-datasource"
#: The uid of the data source lagscope provisions (file or `dashboards push`): the alert
#: rules name it (a rule has no variables), and the dashboards' variable starts on it.
DATASOURCE_UID = "lagscope-clickhouse"
#: The dashboards' data source variable: every query reads `${datasource}`, so a Grafana
#: with another ClickHouse data source (another store, another name) shows the same
#: dashboards by picking it.
DATASOURCE_VARIABLE = "datasource"


def datasource_ref() -> dashboard.DataSourceRef:
    """What every dashboard query and variable reads from: the selected data source."""
    return dashboard.DataSourceRef(type_val=PLUGIN_ID, uid=f"${{{DATASOURCE_VARIABLE}}}")


class Format(enum.IntEnum):
    TIME_SERIES = 0
    TABLE = 1


class QueryType(enum.StrEnum):
    TABLE = "table"
    TIME_SERIES = "timeSeries"


class ClickHouseQuery(cogvariants.Dataquery):
    """One SQL query of the ClickHouse data source."""

    def __init__(
        self,
        raw_sql: str = "",
        *,
        ref_id: str = "A",
        format_val: Format = Format.TABLE,
        query_type: QueryType = QueryType.TABLE,
        datasource: dashboard.DataSourceRef | None = None,
        hide: bool | None = None,
    ) -> None:
        self.raw_sql = raw_sql
        self.ref_id = ref_id
        self.format_val = format_val
        self.query_type = query_type
        self.datasource = datasource if datasource is not None else datasource_ref()
        self.hide = hide

    def to_json(self) -> dict[str, object]:
        payload: dict[str, object] = {
            "refId": self.ref_id,
            "datasource": self.datasource,
            "editorType": "sql",
            "rawSql": self.raw_sql,
            "format": int(self.format_val),
            "queryType": str(self.query_type),
        }
        if self.hide is not None:
            payload["hide"] = self.hide
        return payload

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        if data.get("editorType", "sql") != "sql":
            raise ValueError(f"query {data.get('refId')!r}: only SQL-editor queries are modelled")
        return cls(
            data.get("rawSql", ""),
            ref_id=data.get("refId", "A"),
            format_val=Format(data.get("format", Format.TABLE)),
            query_type=QueryType(data.get("queryType", QueryType.TABLE)),
            datasource=dashboard.DataSourceRef.from_json(data["datasource"])
            if "datasource" in data
            else None,
            hide=data.get("hide"),
        )


class ClickHouseQueryBuilder(cogbuilder.Builder[ClickHouseQuery]):
    """SDK-style builder, accepted wherever a panel takes a target."""

    def __init__(self, raw_sql: str) -> None:
        self._internal = ClickHouseQuery(raw_sql)

    def build(self) -> ClickHouseQuery:
        return self._internal

    def ref_id(self, ref_id: str) -> Self:
        self._internal.ref_id = ref_id
        return self

    def time_series(self) -> Self:
        self._internal.format_val = Format.TIME_SERIES
        self._internal.query_type = QueryType.TIME_SERIES
        return self

    def table(self) -> Self:
        self._internal.format_val = Format.TABLE
        self._internal.query_type = QueryType.TABLE
        return self


class ClickHouseAnnotationTarget(dashboard.AnnotationTarget):
    """An annotation query on the ClickHouse data source: the SDK's `AnnotationTarget`
    only carries the built-in Grafana annotation fields, so this adds the SQL query."""

    def __init__(self, raw_sql: str) -> None:
        super().__init__()
        self.query = ClickHouseQuery(raw_sql, ref_id="Anno")

    def to_json(self) -> dict[str, object]:
        return self.query.to_json()


def register_clickhouse_query() -> None:
    """Let `Dashboard.from_json` decode ClickHouse targets as `ClickHouseQuery`."""
    cogruntime.register_dataquery_variant(
        cogruntime.DataqueryConfig(identifier=PLUGIN_ID, from_json_hook=ClickHouseQuery.from_json)
    )
