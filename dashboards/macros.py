"""Expand a panel's SQL the way Grafana and the ClickHouse data source plugin do before the
query reaches ClickHouse, so the dashboards' SQL can be run (and tested) outside Grafana.

Two passes, in Grafana's order:

1. Template variables (Grafana's frontend, `templateSrv.replace` with the plugin's
   formatter): `$name`, `${name}`, `${name:format}`. A single value is inserted as is (the
   SQL quotes it: `'${job}'`); a multi-value selection becomes `'a','b'` (for `IN (...)`).
   Unknown names, such as `$__timeFilter`, are left for the next pass. Of Grafana's
   named formats, `sqlstring`, `raw`, `queryparam` and `percentencode` are modelled.
2. Plugin macros (the plugin's backend, `pkg/macros`): `$__timeFilter(col)` ->
   `col >= toDateTime(FROM) AND col <= toDateTime(TO)`; `$__timeInterval(col)` ->
   `toStartOfInterval(toDateTime(col), INTERVAL N second)`; `$__fromTime`/`$__toTime` ->
   `toDateTime(epoch s)`; the `_ms` variants with `fromUnixTimestamp64Milli`; and
   `$__interval_s` -> N (the panel's interval in whole seconds, at least 1).
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import quote

_VARIABLE = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\$(\w+)")
_MACRO = re.compile(r"\$__(\w+)(?:\(([^()]*)\))?")


class MacroError(ValueError):
    """A macro the plugin would reject (unknown name or wrong argument count)."""


@dataclass(frozen=True)
class QueryContext:
    """What Grafana knows when it runs a panel's query."""

    time_from: dt.datetime
    time_to: dt.datetime
    interval_s: float = 1.0
    variables: Mapping[str, str | Sequence[str]] = field(default_factory=dict)


def interpolate_variables(sql: str, variables: Mapping[str, str | Sequence[str]]) -> str:
    """Grafana's template-variable pass with the ClickHouse plugin's formatter."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(3)
        fmt = match.group(2)
        if name not in variables:
            return match.group(0)
        value = variables[name]
        values = [value] if isinstance(value, str) else list(value)
        if fmt == "queryparam":
            return "&".join(f"var-{name}={_encode_uri_component_strict(v)}" for v in values)
        if fmt == "percentencode":
            shown = "{" + ",".join(values) + "}" if not isinstance(value, str) else value
            return _encode_uri_component_strict(shown)
        if fmt == "sqlstring":
            return ",".join("'" + v.replace("'", "''") + "'" for v in values)
        if fmt in ("raw", None) and isinstance(value, str):
            return value
        if fmt == "raw":
            return ",".join(values)
        if fmt is None:
            return ",".join(f"'{v}'" for v in values)
        raise MacroError(f"variable format {fmt!r} of ${{{name}}} is not supported here")

    return _VARIABLE.sub(replace, sql)


def _encode_uri_component_strict(value: str) -> str:
    """Grafana's `encodeURIComponentStrict`: JavaScript's encodeURIComponent, which keeps
    letters, digits and -_.!~*'(), with !'()* encoded too: only RFC 3986's unreserved
    characters stay, everything else becomes %XX of its UTF-8 bytes."""
    return quote(value, safe="")


def _epoch_s(moment: dt.datetime) -> int:
    moment = moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)
    return math.floor(moment.timestamp())


def _epoch_ms(moment: dt.datetime) -> int:
    moment = moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)
    return math.floor(moment.timestamp() * 1000)


def expand_macros(sql: str, context: QueryContext) -> str:
    """The plugin's macro pass (after variables were interpolated)."""
    start, end = _epoch_s(context.time_from), _epoch_s(context.time_to)
    start_ms, end_ms = _epoch_ms(context.time_from), _epoch_ms(context.time_to)
    seconds = int(max(context.interval_s, 1))
    milliseconds = int(max(context.interval_s * 1000, 1))

    def one_arg(name: str, args: list[str]) -> str:
        if len(args) != 1:
            raise MacroError(f"$__{name} expects 1 argument, got {len(args)}")
        return args[0]

    def replace(match: re.Match[str]) -> str:
        name, raw_args = match.group(1), match.group(2)
        args = [a.strip() for a in raw_args.split(",")] if raw_args is not None else []
        if name == "timeFilter":
            col = one_arg(name, args)
            return f"{col} >= toDateTime({start}) AND {col} <= toDateTime({end})"
        if name == "timeFilter_ms":
            col = one_arg(name, args)
            return (
                f"{col} >= fromUnixTimestamp64Milli({start_ms}) AND "
                f"{col} <= fromUnixTimestamp64Milli({end_ms})"
            )
        if name == "timeInterval":
            col = one_arg(name, args)
            return f"toStartOfInterval(toDateTime({col}), INTERVAL {seconds} second)"
        if name == "timeInterval_ms":
            col = one_arg(name, args)
            return f"toStartOfInterval(toDateTime64({col}, 3), INTERVAL {milliseconds} millisecond)"
        if name == "fromTime":
            return f"toDateTime({start})"
        if name == "toTime":
            return f"toDateTime({end})"
        if name == "fromTime_ms":
            return f"fromUnixTimestamp64Milli({start_ms})"
        if name == "toTime_ms":
            return f"fromUnixTimestamp64Milli({end_ms})"
        if name == "interval_s":
            return str(seconds)
        raise MacroError(f"unknown macro $__{name}")

    return _MACRO.sub(replace, sql)


def render_sql(sql: str, context: QueryContext) -> str:
    """The SQL ClickHouse receives for `sql` in a panel under `context`."""
    return expand_macros(interpolate_variables(sql, dict(context.variables)), context)
