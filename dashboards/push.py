"""Provision the data source, folder and dashboards in a running Grafana through its HTTP
API (grafana-client), idempotently: everything has a fixed uid, the data source is created
or updated by uid, the folder created once, the dashboards saved with `overwrite: true`, so a
second push updates and never duplicates. The alert rules (`alerts.py`) go in as one rule
group through the alerting provisioning API, replaced whole on every push.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from lagscope.dashboards.definitions import build_all
from lagscope.dashboards.panels import BuiltDashboard
from lagscope.producers.redact import redact_url, scrub, secret_values

PROVISIONING_DIR = Path(__file__).resolve().parent / "provisioning"
DATASOURCE_FILE = PROVISIONING_DIR / "datasources" / "lagscope-clickhouse.yaml"
FOLDER_UID = "lagscope"
FOLDER_TITLE = "lagscope"

_ENV_REFERENCE = re.compile(r"\$\{(\w+)\}")


class PushError(RuntimeError):
    """Grafana refused or could not be reached; the message names the URL and the status."""


@dataclass(frozen=True)
class PushReport:
    datasource: str  # "created" or "updated"
    folder: str  # "created" or "exists"
    dashboards: dict[str, str] = field(default_factory=dict)  # uid -> url Grafana returned
    alert_rules: int = 0  # rules in the rule group put


#: The data source's settings that are not text: the provisioning file's `${VAR}`s are
#: text wherever they stand (Grafana's expansion too), the plugin reads both forms, and the
#: pushed definition carries the types Grafana's own editor writes.
_NUMBERS = ("port",)
_FLAGS = ("secure", "tlsSkipVerify", "tlsAuthWithCACert")


def datasource_definition(
    settings: Mapping[str, str], *, ca_cert: str | None = None
) -> dict[str, Any]:
    """The data source of the provisioning file with the `${VAR}`s of its values filled
    from `settings`, as Grafana fills them from its environment (the same file both paths
    read, so they agree). `ca_cert`: a PEM bundle the plugin trusts for the store's TLS."""
    (datasource,) = yaml.safe_load(DATASOURCE_FILE.read_text())["datasources"]
    missing: set[str] = set()

    def fill(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: fill(item) for key, item in value.items()}
        if isinstance(value, list):
            return [fill(item) for item in value]
        if isinstance(value, str):
            missing.update(set(_ENV_REFERENCE.findall(value)) - set(settings))
            return _ENV_REFERENCE.sub(lambda m: str(settings.get(m.group(1), "")), value)
        return value

    filled = fill(datasource)
    if missing:
        raise ValueError(f"{DATASOURCE_FILE.name}: no value for {', '.join(sorted(missing))}")
    options = filled["jsonData"]
    for name in _NUMBERS:
        if isinstance(options.get(name), str):
            try:
                options[name] = int(options[name])
            except ValueError:
                raise ValueError(f"data source {name} {options[name]!r}: not a number") from None
    for name in _FLAGS:
        if isinstance(options.get(name), str):
            options[name] = options[name].strip().lower() in ("1", "true", "yes", "on")
    if ca_cert is not None:
        options["tlsAuthWithCACert"] = True
        filled.setdefault("secureJsonData", {})["tlsCACert"] = ca_cert
    return filled


def push(
    url: str,
    token: str | None,
    datasource_settings: Mapping[str, str],
    *,
    dashboards: Mapping[str, BuiltDashboard] | None = None,
    alert_rule_group: dict[str, Any] | None = None,
    timeout_s: float = 10.0,
    verify: bool | str = True,
    ca_cert: str | None = None,
) -> PushReport:
    """Upsert the data source, the folder, every dashboard and the alert rule group in the
    Grafana at `url`. `verify`: check Grafana's TLS certificate (False: do not; a path: a
    CA bundle to check it against). `ca_cert`: PEM text the data source trusts for the
    store's TLS. No message shows a password or the token (`producers.redact`)."""
    from grafana_client import GrafanaApi

    from lagscope.dashboards.alerts import RULE_GROUP, rule_group_dict
    from lagscope.dashboards.fleet import build_fleet

    secrets = [token, *secret_values(datasource_settings), urlsplit(url).password or ""]
    shown_url = redact_url(url)
    try:
        api = GrafanaApi.from_url(url, credential=token or None, timeout=timeout_s)
    except ValueError as exc:  # a port that is no number, a broken IPv6 address
        raise PushError(f"Grafana URL {shown_url}: {scrub(str(exc), secrets)}") from None
    api.client.verify = verify
    datasource = datasource_definition(datasource_settings, ca_cert=ca_cert)
    built = dashboards if dashboards is not None else {**build_all(), **build_fleet()}

    call = _grafana_call(shown_url, secrets)
    datasource_state = _upsert_datasource(call, api, datasource)
    folder_state = _ensure_folder(call, api)
    urls = {item.uid: _put_dashboard(call, api, item) for item in built.values()}
    # The runbook links of the rules point at this Grafana (without any login in its URL).
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    public = urlunsplit((parts.scheme, host, parts.path, "", ""))
    group = alert_rule_group if alert_rule_group is not None else rule_group_dict(public)
    # One PUT replaces the whole group: rules removed from the code disappear too.
    call(
        f"PUT alert rule group {RULE_GROUP}",
        api.alertingprovisioning.update_rule_group,
        FOLDER_UID,
        RULE_GROUP,
        group,
    )
    return PushReport(datasource_state, folder_state, urls, len(group["rules"]))


#: Calls Grafana: `call(what, fn, *args)`, a failure a PushError naming `what`.
GrafanaCall = Callable[..., Any]


def _grafana_call(shown_url: str, secrets: list[str]) -> GrafanaCall:
    """`call(what, fn, *args)`: `fn(*args)`, a refusal or an unreachable Grafana a
    PushError naming the URL (without a password), `what` and the status, the secrets
    masked in whatever Grafana said."""
    from grafana_client.client import GrafanaException

    def call(what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except GrafanaException as exc:
            if exc.status_code == 0:
                raise PushError(
                    f"cannot reach Grafana at {shown_url} ({what}): {scrub(str(exc), secrets)}"
                ) from None
            detail = exc.message if hasattr(exc, "message") else str(exc)
            raise PushError(
                f"Grafana at {shown_url} answered HTTP {exc.status_code} to {what}: "
                f"{scrub(str(detail), secrets)}"
            ) from None
        except OSError as exc:  # niquests' connection errors are OSErrors
            raise PushError(
                f"cannot reach Grafana at {shown_url} ({what}): {scrub(str(exc), secrets)}"
            ) from None

    return call


def _upsert_datasource(call: GrafanaCall, api: Any, datasource: dict[str, Any]) -> str:
    uid = datasource["uid"]
    if _exists(call, f"GET datasource {uid}", api.datasource.get_datasource_by_uid, uid):
        call(f"PUT datasource {uid}", api.datasource.update_datasource_by_uid, uid, datasource)
        return "updated"
    call("POST datasource", api.datasource.create_datasource, datasource)
    return "created"


def _ensure_folder(call: GrafanaCall, api: Any) -> str:
    if _exists(call, f"GET folder {FOLDER_UID}", api.folder.get_folder, FOLDER_UID):
        return "exists"
    call("POST folder", api.folder.create_folder, FOLDER_TITLE, FOLDER_UID)
    return "created"


def _put_dashboard(call: GrafanaCall, api: Any, item: BuiltDashboard) -> str:
    """Create or overwrite one dashboard in lagscope's folder; returns its path."""
    answer = call(
        f"POST dashboard {item.uid}",
        api.dashboard.update_dashboard,
        {
            "dashboard": item.to_dict(),
            "folderUid": FOLDER_UID,
            "overwrite": True,
            "message": "lagscope dashboards push",
        },
    )
    return str((answer or {}).get("url", ""))


def _exists(call, what: str, fn, uid: str) -> bool:
    """True if Grafana has the object; a 404 means it does not, any other error is raised."""
    try:
        call(what, fn, uid)
    except PushError as exc:
        if "HTTP 404 " in str(exc):
            return False
        raise
    return True
