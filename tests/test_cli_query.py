"""`lagscope query`: table, CSV and JSON output from chDB; clear errors, exit code 2."""

from __future__ import annotations

import json

import pytest

from lagscope.cli import main
from lagscope.store.sink import ClickHouseSink


@pytest.fixture
def dsn(chdb_dsn: str) -> str:
    with ClickHouseSink(chdb_dsn) as store:
        store.ensure_schema()
        store.command(
            "INSERT INTO jobs (job_id, attempt, world_size, started, meta) VALUES "
            "('job-a', 0, 8, 1700000000, '{}'), ('job-b', 1, 16, 1700000060, '{}')"
        )
    return chdb_dsn


SQL = "SELECT job_id, attempt, world_size, started FROM jobs FINAL ORDER BY job_id"


def test_query_prints_a_table(dsn: str, capsys) -> None:
    assert main(["query", SQL, "--dsn", dsn]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["job_id", "attempt", "world_size", "started"]
    assert lines[2].split()[:3] == ["job-a", "0", "8"]
    assert lines[-1] == "(2 rows)"


def test_query_csv_and_json(dsn: str, capsys) -> None:
    assert main(["query", SQL, "--dsn", dsn, "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "job_id,attempt,world_size,started"
    assert lines[2].startswith("job-b,1,16,")
    assert main(["query", SQL, "--dsn", dsn, "--format", "json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert records[1]["job_id"] == "job-b" and records[1]["world_size"] == 16


def test_dsn_from_the_environment(dsn: str, capsys, monkeypatch) -> None:
    monkeypatch.setenv("LAGSCOPE_CLICKHOUSE_DSN", dsn)
    assert main(["query", "SELECT count() AS n FROM jobs FINAL"]) == 0
    assert "2" in capsys.readouterr().out.splitlines()[2]


def test_sql_error_exits_2_without_traceback(dsn: str, capsys) -> None:
    assert main(["query", "SELECT * FROM no_such_table", "--dsn", dsn]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lagscope query: error: ") and "no_such_table" in err
    assert "Traceback" not in err


def test_missing_chdb_directory_exits_2(tmp_path, capsys) -> None:
    missing = tmp_path / "nothing-here"
    assert main(["query", "SELECT 1", "--dsn", f"chdb://{missing}"]) == 2
    assert "no chDB store" in capsys.readouterr().err
    assert not missing.exists()


@pytest.mark.parametrize("bad", ["postgres://h/db", "chdb:///x?colour=red"])
def test_bad_dsn_exits_2(bad: str, capsys) -> None:
    assert main(["query", "SELECT 1", "--dsn", bad]) == 2
    assert "DSN" in capsys.readouterr().err


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT 1; DROP TABLE jobs",
        "SELECT ';'; DROP TABLE jobs",
        "SELECT '\\\\'; DROP TABLE jobs",
        "SELECT 1 /* ; */; DROP TABLE jobs -- ;",
    ],
)
def test_query_runs_exactly_one_statement(dsn: str, capsys, sql: str) -> None:
    assert main(["query", sql, "--dsn", dsn]) == 2
    err = capsys.readouterr().err
    assert "expected exactly one SQL statement, got 2" in err and "Traceback" not in err
    assert main(["query", "SELECT count() AS n FROM jobs FINAL", "--dsn", dsn]) == 0
    assert capsys.readouterr().out.splitlines()[2].strip() == "2"


def test_query_is_read_only_unless_asked(dsn: str, capsys) -> None:
    assert main(["query", "DROP TABLE jobs", "--dsn", dsn]) == 2
    assert "readonly" in capsys.readouterr().err.lower()
    assert main(["query", "SELECT count() AS n FROM jobs FINAL", "--dsn", dsn]) == 0
    assert capsys.readouterr().out.splitlines()[2].strip() == "2"
    assert main(["query", "ALTER TABLE jobs DELETE WHERE job_id = 'job-a'", "--dsn", dsn,
                 "--write"]) == 0  # fmt: skip


def test_csv_and_json_keep_full_float_precision(dsn: str, capsys) -> None:
    sql = "SELECT 1 / 3 AS third, 2 / 3 AS two_thirds"
    assert main(["query", sql, "--dsn", dsn, "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == f"{1 / 3!r},{2 / 3!r}"
    assert main(["query", sql, "--dsn", dsn, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"third": 1 / 3, "two_thirds": 2 / 3}]


@pytest.mark.slow  # a store large enough to stream (~10 s)
@pytest.mark.parametrize("output_format", ["csv", "table"])
def test_query_streams_rows_instead_of_holding_the_result(
    dsn: str, output_format: str, tmp_path, monkeypatch
) -> None:
    """200k rows (two numbers each) fetched whole take ~29 MB of Python memory; streamed,
    the command holds one block of rows at a time (~11 MB measured)."""
    import sys
    import tracemalloc

    rows = 200_000
    sql = f"SELECT number, number / 3 AS third FROM numbers({rows})"
    with (tmp_path / "out.txt").open("w") as out:
        monkeypatch.setattr(sys, "stdout", out)
        tracemalloc.start()
        try:
            assert main(["query", sql, "--dsn", dsn, "--format", output_format]) == 0
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    written = (tmp_path / "out.txt").read_text().splitlines()
    assert len(written) >= rows
    assert peak < 20e6, f"peak {peak / 1e6:.0f} MB of Python memory for {rows} rows"
