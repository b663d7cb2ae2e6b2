"""`lagscope dashboards build` (write the dashboards' JSON) and `lagscope dashboards push`
(provision data source and dashboards in a Grafana through its HTTP API)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from lagscope.cli.conventions import examples
from lagscope.dashboards.build import GENERATED_DIR

GRAFANA_URL_ENV = "GRAFANA_URL"
GRAFANA_TOKEN_ENV = "GRAFANA_TOKEN"
#: Password of the read-only ClickHouse user the data source connects as.
CLICKHOUSE_PASSWORD_ENV = "CLICKHOUSE_GRAFANA_PASSWORD"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dashboards",
        help="build the Grafana dashboards' JSON or push them to a Grafana",
        description="Grafana dashboards and alert rules as code.",
        epilog=examples(
            "lagscope dashboards build",
            "lagscope dashboards build --check   # in CI: the committed JSON is current",
            "GRAFANA_TOKEN=... lagscope dashboards push --url http://grafana:3000",
        ),
    )
    actions = parser.add_subparsers(dest="dashboards_command", required=True, metavar="ACTION")

    _add_build(actions)
    _add_push(actions)


def _add_build(actions: argparse._SubParsersAction) -> None:
    build = actions.add_parser(
        "build",
        help="write the dashboards' JSON (one file each)",
        description="Writes one JSON file per dashboard and the alert rules' provisioning file.",
        epilog=examples(
            "lagscope dashboards build",
            "lagscope dashboards build --out /etc/grafana/dashboards",
            "lagscope dashboards build --check",
        ),
    )
    build.add_argument(
        "--out", type=Path, default=GENERATED_DIR, metavar="DIR", help="output directory"
    )
    build.add_argument(
        "--alerts-out",
        type=Path,
        default=None,
        help="alert rules provisioning file (default: dashboards/provisioning/alerting/"
        "lagscope-alerts.yaml, which Grafana loads at start-up)",
    )
    build.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if the files in --out differ from a fresh build",
    )
    build.set_defaults(handler=build_command, extra="dashboards")


def _add_push(actions: argparse._SubParsersAction) -> None:
    push = actions.add_parser(
        "push",
        help="create or update the ClickHouse data source and the dashboards in Grafana",
        description="Idempotent: fixed uids, data source upserted by uid, dashboards "
        "overwritten. Exits 2 when Grafana refuses (401/403/404/5xx) or cannot be reached.",
        epilog=examples(
            "GRAFANA_TOKEN=... lagscope dashboards push --url http://grafana:3000",
            "lagscope dashboards push --url http://admin:admin@localhost:3000 "
            "--clickhouse-host localhost",
            "lagscope dashboards push --url https://grafana.example.com --clickhouse-host "
            "ch.example.com --clickhouse-secure --clickhouse-ca-cert ca.pem",
        ),
    )
    push.add_argument("--url", help=f"Grafana base URL (default ${GRAFANA_URL_ENV})")
    push.add_argument(
        "--token", help=f"service-account token (default ${GRAFANA_TOKEN_ENV}; or user:pass@ URL)"
    )
    push.add_argument(
        "--grafana-ca-cert",
        type=Path,
        metavar="PATH",
        help="CA bundle to check an https Grafana's certificate against (default: the system's)",
    )
    _add_clickhouse_options(push)
    push.add_argument(
        "--timeout-s",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="give up on a Grafana request after this long",
    )
    push.set_defaults(handler=push_command, extra="dashboards")


def _add_clickhouse_options(push: argparse.ArgumentParser) -> None:
    """How the data source Grafana gets reaches the store: host, port, TLS, database, user."""
    push.add_argument(
        "--clickhouse-host", default="clickhouse", help="ClickHouse host as Grafana reaches it"
    )
    push.add_argument(
        "--clickhouse-port",
        type=int,
        metavar="PORT",
        help="ClickHouse HTTP port as Grafana reaches it (default 8123, 8443 with "
        "--clickhouse-secure)",
    )
    push.add_argument(
        "--clickhouse-secure",
        action="store_true",
        help="the data source talks TLS (https) to ClickHouse",
    )
    push.add_argument(
        "--clickhouse-ca-cert",
        type=Path,
        metavar="PATH",
        help="with --clickhouse-secure: a PEM CA certificate the data source trusts for "
        "ClickHouse's certificate (default: the system's)",
    )
    push.add_argument(
        "--clickhouse-tls-skip-verify",
        action="store_true",
        help="with --clickhouse-secure: do not check ClickHouse's certificate (test set-ups only)",
    )
    push.add_argument("--clickhouse-database", default="lagscope", help="the database of the store")
    push.add_argument(
        "--clickhouse-user", default="grafana", help="the read-only user for dashboards"
    )
    push.add_argument(
        "--clickhouse-password", help=f"its password (default ${CLICKHOUSE_PASSWORD_ENV})"
    )


def build_command(args: argparse.Namespace) -> int:
    from lagscope.dashboards.build import built_files

    out: Path = args.out
    built = built_files(out, args.alerts_out)
    if args.check:
        missing = [str(path) for path in built if not path.exists()]
        stale = [
            str(path) for path, text in built.items() if path.exists() and path.read_text() != text
        ]
        found = [f"{', '.join(missing)} missing"] if missing else []
        found += [f"{', '.join(stale)} differ from the code"] if stale else []
        if found:
            print(
                f"lagscope dashboards build --check: {'; '.join(found)}; "
                "run `lagscope dashboards build`",
                file=sys.stderr,
            )
            return 1
        dashboards = sum(1 for path in built if path.suffix == ".json")
        print(f"{dashboards} dashboards in {out} and the alert rules are up to date")
        return 0
    # A file of the same name that is not this build's (another dashboard, another set
    # of alert rules) is never overwritten: nothing is written then.
    foreign = [str(p) for p, text in built.items() if p.exists() and _identity(p) != _of(text)]
    if foreign:
        print(
            f"lagscope dashboards build: error: {', '.join(foreign)}: not lagscope's "
            "dashboards or alert rules; move them away or write to another --out",
            file=sys.stderr,
        )
        return 2
    for path, text in built.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


def _identity(path: Path) -> tuple[str, ...] | None:
    """What a written file is, as far as replacing it goes: a dashboard's uid, the alert
    rule groups' names; None for a file that is neither (or unreadable)."""
    try:
        return _of(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return None


def _of(text: str) -> tuple[str, ...] | None:
    import json

    import yaml

    try:
        data = json.loads(text)
    except ValueError:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            return None
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("uid"), str):
        return ("dashboard", data["uid"])
    if data.get("kind") == "PrometheusRule":
        return ("prometheus rule", str(data.get("metadata", {}).get("name")))
    groups = data.get("groups")
    if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        return ("alerts", *sorted(f"{g.get('folder')}/{g.get('name')}" for g in groups))
    return None


def push_command(args: argparse.Namespace) -> int:
    from lagscope.dashboards.push import PushError, push
    from lagscope.producers.redact import redact_url

    url = args.url or os.environ.get(GRAFANA_URL_ENV)
    if not url:
        return _push_error(f"no Grafana URL (--url or ${GRAFANA_URL_ENV})")
    try:
        port = _clickhouse_port(args)
        _check_files(args)
        ca_cert = _clickhouse_ca_cert(args)
    except _OptionError as exc:
        return _push_error(str(exc))
    token = args.token or os.environ.get(GRAFANA_TOKEN_ENV)
    settings = {
        "CLICKHOUSE_HOST": args.clickhouse_host,
        "CLICKHOUSE_PORT": str(port),
        "CLICKHOUSE_SECURE": str(args.clickhouse_secure).lower(),
        "CLICKHOUSE_TLS_SKIP_VERIFY": str(args.clickhouse_tls_skip_verify).lower(),
        "CLICKHOUSE_DATABASE": args.clickhouse_database,
        "CLICKHOUSE_GRAFANA_USER": args.clickhouse_user,
        "CLICKHOUSE_GRAFANA_PASSWORD": args.clickhouse_password
        or os.environ.get(CLICKHOUSE_PASSWORD_ENV, ""),
    }
    verify: bool | str = str(args.grafana_ca_cert) if args.grafana_ca_cert else True
    try:
        report = push(
            url, token, settings, timeout_s=args.timeout_s, verify=verify, ca_cert=ca_cert
        )
    except PushError as exc:
        return _push_error(str(exc))
    shown = redact_url(url).rstrip("/")
    scheme = "https" if args.clickhouse_secure else "http"
    print(f"data source {report.datasource}, folder {report.folder}")
    print(
        f"data source reads {scheme}://{args.clickhouse_host}:{port}, database "
        f"{args.clickhouse_database}, as user {args.clickhouse_user}"
    )
    print(f"alert rules: {report.alert_rules} in group 'lagscope'")
    for uid, path in report.dashboards.items():
        print(f"dashboard {uid}: {shown}{path}")
    return 0


class _OptionError(Exception):
    """An option of `dashboards push` that cannot work (exit 2, one line)."""


def _clickhouse_port(args: argparse.Namespace) -> int:
    """The store's port as Grafana reaches it; TLS options only with --clickhouse-secure."""
    if (args.clickhouse_ca_cert or args.clickhouse_tls_skip_verify) and not args.clickhouse_secure:
        option = (
            "--clickhouse-ca-cert" if args.clickhouse_ca_cert else "--clickhouse-tls-skip-verify"
        )
        raise _OptionError(f"{option} needs --clickhouse-secure (TLS to ClickHouse)")
    port = args.clickhouse_port or (8443 if args.clickhouse_secure else 8123)
    if not 0 < port < 65536:
        raise _OptionError(f"--clickhouse-port {port}: not a port (1-65535)")
    return port


def _check_files(args: argparse.Namespace) -> None:
    for option, path in (
        ("--clickhouse-ca-cert", args.clickhouse_ca_cert),
        ("--grafana-ca-cert", args.grafana_ca_cert),
    ):
        if path is not None and not path.is_file():
            raise _OptionError(f"{option} {path}: no such file")


def _clickhouse_ca_cert(args: argparse.Namespace) -> str | None:
    """The PEM text of --clickhouse-ca-cert, checked to be a certificate."""
    if args.clickhouse_ca_cert is None:
        return None
    try:
        ca_cert = args.clickhouse_ca_cert.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or "not PEM text"
        raise _OptionError(f"--clickhouse-ca-cert {args.clickhouse_ca_cert}: {reason}") from None
    if "-----BEGIN CERTIFICATE-----" not in ca_cert:
        raise _OptionError(f"--clickhouse-ca-cert {args.clickhouse_ca_cert}: not a PEM certificate")
    return ca_cert


def _push_error(message: str) -> int:
    print(f"lagscope dashboards push: error: {message}", file=sys.stderr)
    return 2
