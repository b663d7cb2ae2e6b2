"""`lagscope dashboards push` against an HTTP server implementing the Grafana API endpoints
it uses (tests/grafana_stub.py: no Grafana build can be installed here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lagscope.cli import main
from lagscope.dashboards.fleet import FLEET_UID, NODES_UID
from lagscope.dashboards.job_overview import JOB_OVERVIEW_UID
from lagscope.dashboards.pipeline_health import PIPELINE_HEALTH_UID
from lagscope.dashboards.push import datasource_definition
from lagscope.dashboards.runbook import RUNBOOK_UID
from tests.grafana_stub import GrafanaStub

TOKEN = "glsa_test"


@pytest.fixture
def grafana():
    with GrafanaStub(token=TOKEN) as stub:
        yield stub


def _push(url: str, *extra: str) -> int:
    return main(["dashboards", "push", "--url", url, "--token", TOKEN, "--timeout-s", "5", *extra])


def test_push_creates_then_updates_without_duplicates(
    grafana: GrafanaStub, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _push(grafana.url, "--clickhouse-password", "s3cret") == 0
    state = grafana.state
    assert list(state.datasources) == ["lagscope-clickhouse"]
    assert set(state.dashboards) == {
        JOB_OVERVIEW_UID, PIPELINE_HEALTH_UID, FLEET_UID, NODES_UID, RUNBOOK_UID
    }  # fmt: skip
    assert list(state.folders) == ["lagscope"]
    first = capsys.readouterr().out
    assert "data source created, folder created" in first
    assert "alert rules: 6 in group 'lagscope'" in first
    (group,) = state.rule_groups.values()
    assert list(state.rule_groups) == [("lagscope", "lagscope")]
    assert {rule["uid"] for rule in group["rules"]} >= {"lagscope-slowdown-sustained"}
    # the runbook links point at the Grafana pushed to
    runbook = group["rules"][0]["annotations"]["runbook_url"]
    assert runbook.startswith(f"{grafana.url}/d/{RUNBOOK_UID}/")
    assert f"{grafana.url}/d/{JOB_OVERVIEW_UID}/" in first

    datasource = state.datasources["lagscope-clickhouse"]
    assert datasource["type"] == "grafana-clickhouse-datasource"
    assert datasource["jsonData"]["username"] == "grafana"
    assert datasource["jsonData"]["port"] == 8123
    assert datasource["secureJsonData"]["password"] == "s3cret"

    assert _push(grafana.url, "--clickhouse-password", "s3cret") == 0
    assert "data source updated, folder exists" in capsys.readouterr().out
    assert list(state.datasources) == ["lagscope-clickhouse"]
    assert list(state.folders) == ["lagscope"]
    assert {uid: d["version"] for uid, d in state.dashboards.items()} == {
        JOB_OVERVIEW_UID: 2,
        PIPELINE_HEALTH_UID: 2,
        FLEET_UID: 2,
        NODES_UID: 2,
        RUNBOOK_UID: 2,
    }
    saves = [r for r in state.requests if r.path == "/api/dashboards/db"]
    assert all(r.body["overwrite"] is True and r.body["folderUid"] == "lagscope" for r in saves)
    assert all(r.authorization == f"Bearer {TOKEN}" for r in state.requests)


def test_token_and_url_from_environment(
    grafana: GrafanaStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRAFANA_URL", grafana.url)
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    monkeypatch.setenv("CLICKHOUSE_GRAFANA_PASSWORD", "from-env")
    assert main(["dashboards", "push"]) == 0
    assert grafana.state.datasources["lagscope-clickhouse"]["secureJsonData"] == {
        "password": "from-env"
    }


@pytest.mark.parametrize("status", [401, 403, 404, 500, 503])
def test_refusals_exit_2_naming_url_and_status(
    grafana: GrafanaStub, capsys: pytest.CaptureFixture[str], status: int
) -> None:
    grafana.state.fail_with = status
    assert _push(grafana.url) == 2
    err = capsys.readouterr().err
    assert grafana.url in err and f"HTTP {status}" in err
    assert not grafana.state.dashboards


def test_wrong_token_is_a_401(grafana: GrafanaStub, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dashboards", "push", "--url", grafana.url, "--token", "wrong"]) == 2
    assert "HTTP 401" in capsys.readouterr().err


def test_dashboard_save_refused(grafana: GrafanaStub, capsys: pytest.CaptureFixture[str]) -> None:
    grafana.state.fail_dashboards_with = 500
    assert _push(grafana.url) == 2
    err = capsys.readouterr().err
    assert "HTTP 500" in err and JOB_OVERVIEW_UID in err


def test_unreachable_grafana(capsys: pytest.CaptureFixture[str]) -> None:
    with GrafanaStub() as stub:
        url = stub.url  # a port that was just free and is closed again below
    assert _push(url) == 2
    assert f"cannot reach Grafana at {url}" in capsys.readouterr().err


def test_no_url(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("GRAFANA_URL", raising=False)
    assert main(["dashboards", "push"]) == 2
    assert "no Grafana URL" in capsys.readouterr().err


def test_datasource_definition_fills_every_placeholder() -> None:
    settings = {
        "CLICKHOUSE_HOST": "ch",
        "CLICKHOUSE_PORT": "8443",
        "CLICKHOUSE_SECURE": "true",
        "CLICKHOUSE_TLS_SKIP_VERIFY": "false",
        "CLICKHOUSE_DATABASE": "lagscope",
        "CLICKHOUSE_GRAFANA_USER": "grafana",
        "CLICKHOUSE_GRAFANA_PASSWORD": "pw",
    }
    datasource = datasource_definition(settings)
    assert datasource["uid"] == "lagscope-clickhouse"
    assert datasource["jsonData"]["host"] == "ch"
    # typed as Grafana's own editor writes them, whatever the provisioning text says
    assert datasource["jsonData"]["port"] == 8443
    assert datasource["jsonData"]["secure"] is True
    assert datasource["jsonData"]["tlsSkipVerify"] is False
    assert "$" not in repr(datasource)
    with pytest.raises(ValueError, match="CLICKHOUSE_HOST"):
        datasource_definition({k: v for k, v in settings.items() if k != "CLICKHOUSE_HOST"})


def test_port_and_tls_options_reach_the_data_source(
    grafana: GrafanaStub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    assert (
        _push(
            grafana.url,
            "--clickhouse-host",
            "ch.example.com",
            "--clickhouse-port",
            "9443",
            "--clickhouse-secure",
            "--clickhouse-ca-cert",
            str(ca),
        )
        == 0
    )
    datasource = grafana.state.datasources["lagscope-clickhouse"]
    assert datasource["jsonData"]["host"] == "ch.example.com"
    assert datasource["jsonData"]["port"] == 9443
    assert datasource["jsonData"]["secure"] is True
    assert datasource["jsonData"]["tlsSkipVerify"] is False
    assert datasource["jsonData"]["tlsAuthWithCACert"] is True
    assert datasource["secureJsonData"]["tlsCACert"] == ca.read_text()
    assert "https://ch.example.com:9443" in capsys.readouterr().out


def test_tls_to_clickhouse_takes_its_own_port_by_default(grafana: GrafanaStub) -> None:
    assert _push(grafana.url, "--clickhouse-secure", "--clickhouse-tls-skip-verify") == 0
    options = grafana.state.datasources["lagscope-clickhouse"]["jsonData"]
    assert (options["port"], options["secure"], options["tlsSkipVerify"]) == (8443, True, True)
    assert _push(grafana.url) == 0
    options = grafana.state.datasources["lagscope-clickhouse"]["jsonData"]
    assert (options["port"], options["secure"], options["tlsSkipVerify"]) == (8123, False, False)


@pytest.mark.parametrize(
    "args,problem",
    [
        (["--clickhouse-tls-skip-verify"], "needs --clickhouse-secure"),
        (["--clickhouse-secure", "--clickhouse-ca-cert", "missing.pem"], "no such file"),
        (["--clickhouse-port", "70000"], "not a port"),
        (["--grafana-ca-cert", "missing.pem"], "no such file"),
    ],
)
def test_tls_mistakes_are_one_line(
    grafana: GrafanaStub, capsys: pytest.CaptureFixture[str], args: list[str], problem: str
) -> None:
    assert _push(grafana.url, *args) == 2
    err = capsys.readouterr().err
    assert problem in err and len(err.strip().splitlines()) == 1
    assert not grafana.state.requests
