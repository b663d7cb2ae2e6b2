"""Alert rules as code: valid for grafana-foundation-sdk's alerting model, provisioned from
a committed file that matches the code, and every rule's query run on chDB: on the demo's
output, and on stores made to make each rule fire or stay quiet."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml
from grafana_foundation_sdk.models import alerting as alerting_model
from grafana_foundation_sdk.models import expr as expr_model

from lagscope.dashboards.alerts import (
    ALERTS_FILE,
    DASHBOARD_TITLES,
    RULES,
    SLOWDOWN_THRESHOLD,
    AlertRule,
    provisioning_file,
    rule_group_dict,
)
from lagscope.dashboards.clickhouse_query import ClickHouseQuery, register_clickhouse_query
from lagscope.dashboards.definitions import build_all
from lagscope.producers.events import JobInfo, RankIdentity
from lagscope.simulator.diagnose import diagnose
from lagscope.simulator.generate import CostModel, JobSpec, generate_job
from lagscope.simulator.prepare import prepare
from lagscope.simulator.whatif import analyze
from lagscope.store.rows import diagnosis_rows
from lagscope.store.sink import SinkBatch
from lagscope.stream_app.host_core import JobRecords
from tests.demo_store import DEMO_JOB, fill_demo_store

BY_UID = {rule.uid: rule for rule in RULES}


def test_rules_are_a_fixed_point_of_the_sdk_model() -> None:
    register_clickhouse_query()
    group = rule_group_dict()
    decoded = alerting_model.RuleGroup.from_json(group)
    assert [r.uid for r in decoded.rules or []] == [rule.uid for rule in RULES]
    for rule in group["rules"]:
        alerting_model.Rule.from_json(rule)
        source, condition = rule["data"]
        assert isinstance(ClickHouseQuery.from_json(source["model"]), ClickHouseQuery)
        assert source["datasourceUid"] == "lagscope-clickhouse"
        threshold = expr_model.TypeThreshold.from_json(condition["model"])
        assert threshold.expression == "A" and rule["condition"] == "B"
        assert condition["datasourceUid"] == "__expr__"


def test_provisioning_file_is_what_the_code_builds() -> None:
    assert ALERTS_FILE.read_text() == provisioning_file(), (
        f"{ALERTS_FILE} is stale: run `lagscope dashboards build`"
    )
    document = yaml.safe_load(ALERTS_FILE.read_text())
    assert document["apiVersion"] == 1
    (group,) = document["groups"]
    assert group["folder"] == "lagscope" and group["interval"] == "1m"
    assert {r["uid"] for r in group["rules"]} == set(BY_UID)


def test_every_runbook_names_panels_that_exist() -> None:
    titles = {
        item.uid: {p["title"] for p in item.to_dict()["panels"]} for item in build_all().values()
    }
    for rule in RULES:
        assert rule.dashboard_uid in DASHBOARD_TITLES
        missing = set(rule.next_panels) - titles[rule.dashboard_uid]
        assert not missing, f"{rule.uid}: no panel {missing} in {rule.dashboard_uid}"


def test_no_runbook_sends_the_reader_to_a_text_panel() -> None:
    """A runbook's panels show data: a text placeholder answers nothing at 3 a.m."""
    kinds = {
        item.uid: {p["title"]: p["type"] for p in item.to_dict()["panels"]}
        for item in build_all().values()
    }
    for rule in RULES:
        for panel in rule.next_panels:
            assert kinds[rule.dashboard_uid][panel] != "text", f"{rule.uid}: {panel!r} is text"


def test_every_rule_has_a_description_and_a_runbook_link_to_its_own_panel() -> None:
    """What Grafana shows and sends with an alert: a description (what it means, where to
    look) and runbook_url, which opens the rule's panel of the runbook dashboard."""
    from lagscope.dashboards.fleet import build_fleet
    from lagscope.dashboards.prometheus_rules import ALERTS
    from lagscope.dashboards.runbook import RUNBOOK_UID, panel_id

    runbook = build_fleet()["runbook"].to_dict()
    assert runbook["uid"] == RUNBOOK_UID
    panels = {p["id"]: p for p in runbook["panels"] if p["type"] == "text"}
    assert len(panels) == len(RULES) + len(ALERTS)  # one each, no two on one id
    for rule in rule_group_dict()["rules"]:
        annotations = rule["annotations"]
        assert "runbook" not in annotations
        assert len(annotations["description"]) > 40, rule["uid"]
        url = annotations["runbook_url"]
        assert url == f"/d/{RUNBOOK_UID}/lagscope-runbook?viewPanel=panel-{panel_id(rule['uid'])}"
        panel = panels[panel_id(rule["uid"])]
        assert panel["title"] == rule["title"]
        assert BY_UID[rule["uid"]].actions[0] in panel["options"]["content"]
    # pushed to a Grafana, the links are that Grafana's (never with a login in them)
    pushed = rule_group_dict("https://grafana.corp:3000")["rules"][0]["annotations"]
    assert pushed["runbook_url"].startswith("https://grafana.corp:3000/d/lagscope-runbook/")


def test_the_prometheus_rule_is_what_the_code_builds_and_names_real_metrics() -> None:
    import inspect

    from lagscope.dashboards.prometheus_rules import (
        ALERTS,
        PROMETHEUS_RULE_FILE,
        prometheus_rule_file,
    )
    from lagscope.producers import metrics, streamer
    from lagscope.stream_app import worker_metrics

    assert PROMETHEUS_RULE_FILE.read_text() == prometheus_rule_file(), (
        f"{PROMETHEUS_RULE_FILE} is stale: run `lagscope dashboards build`"
    )
    document = yaml.safe_load(PROMETHEUS_RULE_FILE.read_text())
    assert (document["apiVersion"], document["kind"]) == (
        "monitoring.coreos.com/v1",
        "PrometheusRule",
    )
    (group,) = document["spec"]["groups"]
    assert [r["alert"] for r in group["rules"]] == [a.name for a in ALERTS]
    exported = "".join(inspect.getsource(m) for m in (metrics, streamer, worker_metrics))
    for rule in group["rules"]:
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"])
        assert rule["labels"]["severity"] in ("page", "ticket")
        for name in set(re.findall(r"\blagscope_\w+", rule["expr"])):
            assert f'"{name}"' in exported, f"{rule['alert']}: nothing exports {name}"
    # what the issue asks to be watched
    names = {a.name for a in ALERTS}
    assert {"LagscopeWorkerDown", "LagscopeConsumerLagGrowing", "LagscopeStoreFailing",
            "LagscopeCheckpointsStale"} <= names  # fmt: skip


def _rows(sink, rule: AlertRule) -> list[dict]:
    result = sink.client.query(rule.sql)
    rows = list(result.named_results())
    for row in rows:
        assert isinstance(row["value"], float | int), f"{rule.uid}: value is {row['value']!r}"
        labels = {k: v for k, v in row.items() if k != "value"}
        assert all(isinstance(v, str) for v in labels.values()), f"{rule.uid}: {labels}"
    return rows


# -- the demo's output --------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_sink(chdb_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    return fill_demo_store(
        f"chdb://{chdb_dir}?database=alerts_demo", tmp_path_factory.mktemp("alerts-demo")
    )


@pytest.mark.parametrize("uid", sorted(BY_UID))
def test_every_rule_query_runs_on_the_demo_store(demo_sink, uid: str) -> None:
    rule = BY_UID[uid]
    rows = _rows(demo_sink, rule)
    # The demo ran for about a minute, just now: its job is live, not silent, and the
    # windows that need ten minutes of history have none.
    if uid == "lagscope-job-silent":
        assert [r["job_id"] for r in rows] == [DEMO_JOB]
        assert not rule.firing(rows)
    if uid in ("lagscope-slowdown-sustained", "lagscope-dead-letters-rising"):
        assert not rule.firing(rows)


def test_the_demo_straggler_is_an_episode_that_recovered_so_its_alert_is_quiet(demo_sink):
    """The demo's slow worker (dp 5, pp 2) is an episode in the store, closed at its
    recovery: the alert on open episodes does not fire after the straggler has gone, and
    no other worker (nor a stage that looked faster meanwhile) is an episode."""
    episodes = list(
        demo_sink.client.query(
            "SELECT dp_rank, pp_rank, state, onset_step, recovery_step FROM episodes FINAL"
        ).named_results()
    )
    assert [(e["dp_rank"], e["pp_rank"], e["state"]) for e in episodes] == [(5, 2, "closed")]
    rule = BY_UID["lagscope-episode-open"]
    assert not rule.firing(_rows(demo_sink, rule))


# -- made to fire or to stay quiet ----------------------------------------------------------


@pytest.fixture(scope="module")
def crafted(chdb_dir: Path):
    """Jobs built to make the rules decide: `sick` (slow for 12 minutes, MFU fallen,
    rank 5 gone, an open episode, rising dead letters), `healthy` (all fine, an episode
    that recovered, a steady trickle of dead letters), `stalled` (stopped 8 minutes ago,
    its episode left open), `finished` and `half-ended` (stopped as `stalled`, every rank
    or half of them said they ended), `finished-long-ago` (stopped 3 hours ago) and
    `noisy` and `noisy-ddp` (S about 1.3, all of it their own noise floor)."""
    from lagscope.store.sink import ClickHouseSink

    sink = ClickHouseSink(f"chdb://{chdb_dir}?database=alerts_crafted")
    sink.ensure_schema()

    def steps(job: str, age_from_s: int, age_to_s: int, slowdown: str, mfu: str, missing: str):
        # One step every 10 s from `age_from_s` ago to `age_to_s` ago; `slowdown`, `mfu`
        # and `missing` are SQL of `age` (seconds before now).
        sink.command(
            f"""INSERT INTO steps (job_id, attempt, step, ts, complete, missing_ranks,
                actual_s, simulated_s, ideal_s, slowdown, launch_slowdown, waste,
                mfu_actual, mfu_ideal, n_gpus, gpu_seconds, gpu_seconds_wasted,
                processed_at, version)
            SELECT '{job}', 0, number, now64(3) - age, empty(m), m, 10, 10, 10 / s, s, 1,
                   1 - 1 / s, f, 0.45, 8, 80, 80 * (1 - 1 / s), now64(3) - age, 1
            FROM (SELECT number, {age_from_s} - number * 10 AS age, {slowdown} AS s,
                         {mfu} AS f, {missing} AS m
                  FROM numbers(intDiv({age_from_s - age_to_s}, 10) + 1))"""
        )

    no_rank: str = "CAST([], 'Array(UInt32)')"
    steps("sick", 720, 0, "1.3", "if(age < 600, 0.30, 0.45)", f"if(age < 60, [5], {no_rank})")
    steps("healthy", 720, 0, "1.02", "0.44 + (number % 3) * 0.005", no_rank)
    steps("stalled", 1500, 480, "1.01", "0.45", no_rank)
    steps("finished-long-ago", 4 * 3600, 3 * 3600, "1.0", "0.45", no_rank)

    def changepoint(job: str, series: str, age_s: int, kind: str) -> None:
        sink.command(
            f"""INSERT INTO changepoints (job_id, attempt, series, step, ts, kind,
                before_mean, after_mean, probability, version)
            VALUES ('{job}', 0, '{series}', {10_000 - age_s}, now64(3) - {age_s}, '{kind}',
                    1.0, 1.3, 0.9, 1)"""
        )

    changepoint("sick", "stage 3", 300, "onset")
    changepoint("healthy", "dp 2", 600, "onset")
    changepoint("healthy", "dp 2", 240, "recovery")

    def dead_letters(job: str, ages_s: list[int]) -> None:
        for i, age in enumerate(ages_s):
            sink.command(
                f"""INSERT INTO dead_letters (ts, job_id, source, reason, payload)
                VALUES (now64(3) - {age}, '{job}', 'log', 'garbage', 'payload {job} {i}')"""
            )

    dead_letters("sick", [900, 400, 300, 200, 100])
    dead_letters("healthy", [1000, 800, 500, 200])

    def episode(job: str, episode_id: int, onset_age_s: int, last_age_s: int, open_: bool):
        state, recovery = ("open", "NULL") if open_ else ("closed", f"now64(3) - {last_age_s}")
        sink.command(
            f"""INSERT INTO episodes (job_id, attempt, episode_id, state, onset_step,
                recovery_step, onset_ts, recovery_ts, last_step, last_ts, cause, optype,
                dp_rank, pp_rank, workers, node, host, gpu, share, lost_s, gpu_seconds_lost,
                first_seen_step, final, summary, evidence, advice, updated_at, version)
            VALUES ('{job}', 0, {episode_id}, '{state}', 100, {"NULL" if open_ else 130},
                    now64(3) - {onset_age_s}, {recovery}, 140, now64(3) - {last_age_s},
                    'slow_host', 'host', 1, 0, ['(dp 1, pp 0)'], 'node-3', 'node-3', 5, 0.8,
                    12.0, 96.0, 104, false, 'the host of worker (dp 1, pp 0) stalls', '{{}}',
                    '{{}}', now64(3), 280)"""
        )

    episode("sick", 1, 600, 10, open_=True)
    episode("healthy", 1, 900, 300, open_=False)
    # Open when its job stopped reporting 20 minutes ago: "Job silent" speaks for it.
    episode("stalled", 1, 1500, 1200, open_=True)
    # Jobs that stopped 8 minutes ago as `stalled` did, their records as lagscope takes
    # them: `finished`, every rank of which said it ended (its monitor closed), a
    # straggler still open at its last step; `half-ended`, half of whose ranks did. An
    # ended job is done: no rule about a job fires for it (`ended-sick`).
    steps("finished", 1500, 480, "1.01", "0.45", no_rank)
    episode("finished", 1, 1500, 480, open_=True)
    steps("half-ended", 1500, 480, "1.01", "0.45", no_rank)
    # As sick as `sick` to its last step, just now, when every rank of it ended.
    steps("ended-sick", 720, 0, "1.3", "if(age < 600, 0.30, 0.45)",
          f"if(age < 60, [5], {no_rank})")  # fmt: skip
    episode("ended-sick", 1, 600, 0, open_=True)
    records = JobRecords(max_world_size=1 << 20)
    ends = {"finished": (8, 480), "half-ended": (4, 480), "ended-sick": (8, 0)}
    for job, (ranks_ended, ended_age_s) in ends.items():
        ended_ns = time.time_ns() - ended_age_s * 10**9
        for rank in range(8):
            records.take(_rank_record(job, rank).encode(), "crafted", time.time() - 1500)
        for rank in range(ranks_ended):
            records.take(_rank_record(job, rank, ended_ns).encode(), "crafted", time.time())
    assert not records.dead_letters
    records.write(sink)
    # A healthy job on a busy machine: S 1.3 for 12 minutes, all of it its own jitter.
    steps("noisy", 720, 0, "1.3", "0.45", no_rank)
    sink.command(
        """INSERT INTO diagnoses (job_id, attempt, step, ts, cause, evidence, advice,
            predicted_speedup, version)
        VALUES ('noisy', 0, 72, now64(3), 'none',
                '{"summary": "no straggling beyond noise", "slowdown": 1.3, "noise_floor": 1.28}',
                '{}', NULL, 144)"""
    )
    # The same on a DDP job, its diagnosis as lagscope writes it: one micro-batch a step,
    # so its evidence has a figure without a value (the forward-backward correlation).
    noisy_ddp = _noisy_ddp_diagnosis()
    figures = noisy_ddp.evidence.as_dict()
    assert figures["fwd_bwd_correlation"] != figures["fwd_bwd_correlation"]  # NaN
    # Its steps at the S it was diagnosed with, above the rule's threshold.
    assert figures["slowdown"] > SLOWDOWN_THRESHOLD
    steps("noisy-ddp", 720, 0, repr(figures["slowdown"]), "0.45", no_rank)
    batch = SinkBatch("noisy-ddp/diagnosis")
    batch.add("diagnoses", diagnosis_rows("noisy-ddp", 0, 72, time.time_ns(), noisy_ddp))
    sink.write(batch)
    return sink


def _rank_record(job: str, rank: int, ended_ns: int | None = None) -> str:
    """A rank's job record of an 8-rank DDP job, as its monitor writes it (at its start;
    with `ended_ns`, at its close)."""
    info = JobInfo(job_id=job, dp_size=8, pp_size=1, tp_size=1, world_size=8,
                   rank_identity=RankIdentity(rank=rank, dp_rank=rank, host=f"node-{rank // 4}"),
                   ended_ns=ended_ns)  # fmt: skip
    return info.model_dump_json()


def _noisy_ddp_diagnosis():
    """The diagnosis of a healthy DDP job (8 ranks) whose every op jitters by 25 %: its
    noise floor about S 1.3, the job's own."""
    spec = JobSpec(
        dp=8, pp=1, microbatches=1, steps=40, seed=3,
        cost=CostModel(first_stage_extra=0.0, last_stage_extra=0.0, noise_cv=0.25),
    )  # fmt: skip
    job = generate_job(spec)
    prepared = prepare(job.trace, job.meta)
    found = diagnose(analyze(prepared), prepared)
    assert found.cause == "none" and found.evidence.noise_floor >= 1.1, found.summary
    return found


EXPECTED_FIRING = {
    "lagscope-slowdown-sustained": {"sick"},
    "lagscope-episode-open": {"sick"},
    "lagscope-job-silent": {"stalled", "half-ended"},
    "lagscope-rank-silent": {"sick"},
    "lagscope-mfu-below-baseline": {"sick"},
    "lagscope-dead-letters-rising": {"sick"},
}


@pytest.mark.parametrize("uid", sorted(EXPECTED_FIRING))
def test_rule_fires_on_the_sick_job_and_stays_quiet_on_the_rest(crafted, uid: str) -> None:
    rule = BY_UID[uid]
    rows = _rows(crafted, rule)
    firing = rule.firing(rows)
    assert {r["job_id"] for r in firing} == EXPECTED_FIRING[uid], json.dumps(rows, default=str)
    if uid == "lagscope-rank-silent":
        assert [r["rank"] for r in firing] == ["5"]
    if uid == "lagscope-episode-open":
        # The annotation's facts are the alert's labels: who, where, in what, since when.
        ((alert),) = firing
        assert (alert["worker"], alert["node"], alert["gpu"], alert["op"]) == (
            "(dp 1, pp 0)",
            "node-3",
            "5",
            "host",
        )
        assert (alert["onset_step"], alert["first_seen_step"]) == ("100", "104")
        assert alert["value"] == pytest.approx(96.0 / 3600)


def test_readme_on_call_explains_every_rule() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    on_call = readme.split("## On call", 1)[1].split("\n## ", 1)[0]
    for rule in RULES:
        assert f"| {rule.title} (" in on_call, f"README 'On call' lacks {rule.title!r}"
        for panel in rule.next_panels:
            assert f'"{panel}"' in on_call, f"README 'On call' lacks panel {panel!r}"
