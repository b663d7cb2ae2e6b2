"""Grafana alert rules as code: what pages the on-call engineer, and why.

Each rule is one ClickHouse query that returns one row per thing that may be in trouble
(string columns become the alert's labels, `value` is what the threshold looks at) and a
threshold on `value`. The queries read the store directly, relative to `now()`, so a rule
says everything it needs in its SQL; the tests run every query on chDB, filled by the demo
and by data made to fire or to stay quiet, and apply the same threshold as Grafana.

| rule | fires when |
|---|---|
| slowdown sustained | every minute of the last 10 ran 1.10x above the job's noise floor |
| straggler episode open | a verified straggler episode is open (the worker is slow now) |
| job silent | a job that reported in the last hour has sent no step for 5 minutes |
| rank silent | one rank was missing from 3 or more steps in the last 10 minutes |
| MFU below baseline | MFU of the last 10 minutes is below 85 % of the attempt's own p90 |
| dead letters rising | more dead letters in the last 10 minutes than in the 10 before |

Rules are built with grafana-foundation-sdk's alerting types and written two ways: the
file Grafana provisions at start-up (`provisioning/alerting/lagscope-alerts.yaml`, JSON
being YAML) and the rule group `lagscope dashboards push` puts through the HTTP API. Each
carries a `summary`, a `description` (what it means, which panels to read) and a
`runbook_url`: its panel of the runbook dashboard (`runbook.py`), relative to the Grafana
that shows it in the provisioned file, absolute (the Grafana pushed to) from `push`.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from grafana_foundation_sdk.builders import alerting, expr
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import alerting as alerting_model
from grafana_foundation_sdk.models import expr as expr_model

from lagscope.dashboards.clickhouse_query import DATASOURCE_UID, ClickHouseQueryBuilder
from lagscope.dashboards.job_overview import JOB_OVERVIEW_UID
from lagscope.dashboards.panels import ENDED_JOBS
from lagscope.dashboards.pipeline_health import PIPELINE_HEALTH_UID
from lagscope.dashboards.runbook import runbook_url
from lagscope.store.schema import EPISODES_TABLE

FOLDER_UID = "lagscope"
RULE_GROUP = "lagscope"
EVALUATION_INTERVAL = "1m"
DASHBOARD_TITLES = {
    JOB_OVERVIEW_UID: "lagscope: job overview",
    PIPELINE_HEALTH_UID: "lagscope: pipeline health",
}
ALERTS_FILE = Path(__file__).resolve().parent / "provisioning/alerting/lagscope-alerts.yaml"

#: Slowdown above which a job is paged about, and for how many minutes it must hold.
SLOWDOWN_THRESHOLD = 1.10
SUSTAINED_MINUTES = 10
#: A job counts as silent after this long without a step (and is forgotten after an hour:
#: a finished job stops reporting too, and there is no "finished" record to tell).
SILENT_AFTER_S = 300
#: A rank counts as silent when missing from this many steps within the window.
RANK_MISSING_STEPS = 3
MFU_FRACTION_OF_BASELINE = 0.85

ThresholdKind = Literal["gt", "lt"]
_COMPARE: dict[ThresholdKind, Callable[[float, float], bool]] = {
    "gt": operator.gt,
    "lt": operator.lt,
}


@dataclass(frozen=True)
class AlertRule:
    """One rule: its query, its threshold on `value`, and what to tell a person."""

    uid: str
    title: str
    sql: str
    threshold: float
    kind: ThresholdKind
    summary: str
    #: What to look at next: the dashboard, and its panels (titles) in the order to read.
    dashboard_uid: str
    next_panels: tuple[str, ...]
    #: When it fires, in words; what it means (likely causes); what to do, in order.
    fires_when: str
    description: str
    actions: tuple[str, ...]
    severity: Literal["page", "ticket"] = "page"

    def fires(self, value: float) -> bool:
        """Grafana's threshold expression on one row's `value`."""
        return _COMPARE[self.kind](value, self.threshold)

    def firing(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows of the query result for which the rule fires."""
        return [row for row in rows if row["value"] is not None and self.fires(row["value"])]

    def next_steps(self) -> str:
        dashboard = DASHBOARD_TITLES[self.dashboard_uid]
        return f"Open '{dashboard}': " + ", then ".join(f"'{p}'" for p in self.next_panels)

    def builder(self, grafana_url: str = "") -> alerting.Rule:
        query = ClickHouseQueryBuilder(_dedent(self.sql)).ref_id("A").table()
        source = (
            alerting.Query("A")
            .datasource_uid(DATASOURCE_UID)
            .relative_time_range(alerting_model.RelativeTimeRange(from_val=3600, to=0))
            .model(query)
        )
        threshold = (
            expr.TypeThreshold()
            .ref_id("B")
            .expression("A")
            .conditions(
                [
                    _ThresholdCondition(
                        expr_model.ExprTypeThresholdConditions(
                            evaluator=expr_model.ExprTypeThresholdConditionsEvaluator(
                                params=[self.threshold], type_val=self.kind
                            )
                        )
                    )
                ]
            )
        )
        condition = (
            alerting.Query("B")
            .datasource_uid("__expr__")
            .relative_time_range(alerting_model.RelativeTimeRange(from_val=0, to=0))
            .model(threshold)
        )
        return (
            alerting.Rule(self.title)
            .uid(self.uid)
            .folder_uid(FOLDER_UID)
            .org_id(1)
            .rule_group(RULE_GROUP)
            .queries([source, condition])
            .condition("B")
            .for_val("1m")
            .no_data_state("OK")
            .exec_err_state("Error")
            .labels({"team": "lagscope", "severity": self.severity})
            .annotations(
                {
                    "summary": self.summary,
                    "description": f"{self.description} {self.next_steps()}.",
                    "runbook_url": runbook_url(self.uid, grafana_url),
                    "__dashboardUid__": self.dashboard_uid,
                }
            )
        )


class _ThresholdCondition:
    """A built threshold condition handed to the SDK's list-of-builders setter."""

    def __init__(self, built: expr_model.ExprTypeThresholdConditions) -> None:
        self._built = built

    def build(self) -> expr_model.ExprTypeThresholdConditions:
        return self._built


def _dedent(sql: str) -> str:
    return "\n".join(line.strip() for line in sql.strip().splitlines())


RULES: tuple[AlertRule, ...] = (
    AlertRule(
        uid="lagscope-slowdown-sustained",
        title="Slowdown sustained",
        # A healthy job's steps are not at S = 1: its own jitter gives its noise floor
        # (the latest diagnosis states it), and only straggling beyond that pages.
        sql=f"""
            SELECT s.job_id AS job_id, toString(s.attempt) AS attempt,
                   min(s.minute_slowdown) / greatest(any(f.floor), 1.0) AS value
            FROM (
                SELECT job_id, attempt, toStartOfMinute(ts) AS minute,
                       avgIf(slowdown, isFinite(slowdown)) AS minute_slowdown
                FROM steps FINAL
                WHERE ts >= now() - INTERVAL {SUSTAINED_MINUTES} MINUTE
                  AND (job_id, attempt) NOT IN {ENDED_JOBS}
                GROUP BY job_id, attempt, minute
            ) AS s
            LEFT JOIN (
                SELECT job_id, attempt,
                       argMax(JSONExtractFloat(evidence, 'noise_floor'), (step, version))
                           AS floor
                FROM diagnoses FINAL
                GROUP BY job_id, attempt
            ) AS f ON f.job_id = s.job_id AND f.attempt = s.attempt
            WHERE isFinite(s.minute_slowdown)
            GROUP BY s.job_id, s.attempt
            HAVING count() >= {SUSTAINED_MINUTES - 1}
        """,
        threshold=SLOWDOWN_THRESHOLD,
        kind="gt",
        summary=f"Job {{{{ $labels.job_id }}}} (attempt {{{{ $labels.attempt }}}}) has run "
        f"at least {SLOWDOWN_THRESHOLD:.2f}x slower than its own noise floor for "
        f"{SUSTAINED_MINUTES} minutes (best minute: {{{{ $values.A }}}}x the floor).",
        dashboard_uid=JOB_OVERVIEW_UID,
        next_panels=("Straggler episodes", "Slowdown S per step", "Top stragglers in range"),
        fires_when=f"every minute of the last {SUSTAINED_MINUTES} ran {SLOWDOWN_THRESHOLD:.2f}x "
        "above the job's own noise floor",
        description="The job's steps take longer than they would without their slowest "
        "workers, beyond the job's own jitter, for ten minutes: GPU-hours are being lost "
        "now.",
        actions=(
            "Read the open episode: which worker, node and GPU, slow in which op, since "
            "when, and the diagnosis' advice (its predicted speed-up).",
            "A node to blame (a slow GPU, a throttled link): drain it and restart the job "
            "from its last checkpoint without it, if the advice's saving is worth the "
            "restart.",
            "No single worker (imbalance, the input pipeline): the job's owners, with "
            "the diagnosis.",
        ),
    ),
    AlertRule(
        uid="lagscope-episode-open",
        title="Straggler episode open",
        # One alert per open episode, its labels fixed for the episode's life (a label
        # that changed every minute would make a new alert each time): who, where, in
        # what, since when; its cost so far is the value. Every open episode fires; one
        # whose job stopped reporting for 15 minutes is left to "Job silent", one whose
        # job ended (still slow at its last step) costs nothing more.
        sql=f"""
            SELECT job_id, toString(attempt) AS attempt, toString(episode_id) AS episode,
                   arrayStringConcat(workers, ', ') AS worker, node,
                   if(isNull(gpu), '', toString(gpu)) AS gpu, optype AS op, cause,
                   toString(onset_step) AS onset_step,
                   toString(first_seen_step) AS first_seen_step,
                   gpu_seconds_lost / 3600 AS value
            FROM {EPISODES_TABLE} FINAL
            WHERE state = 'open' AND last_ts >= now() - INTERVAL 15 MINUTE
              AND (job_id, attempt) NOT IN {ENDED_JOBS}
        """,
        threshold=-1.0,
        kind="gt",
        summary="Job {{ $labels.job_id }} (attempt {{ $labels.attempt }}): worker "
        "{{ $labels.worker }} on {{ $labels.node }} GPU {{ $labels.gpu }} is a straggler "
        "({{ $labels.cause }}, slow in {{ $labels.op }}) since step {{ $labels.onset_step }} "
        "(seen at step {{ $labels.first_seen_step }}); it has cost {{ $values.A }} GPU-hours "
        "so far.",
        dashboard_uid=JOB_OVERVIEW_UID,
        next_panels=("Straggler episodes", "Current diagnosis and advice"),
        fires_when="a verified straggler episode of a running job is open",
        description="A worker is verified slower than its peers now (its value: the "
        "GPU-hours it has cost so far). It resolves when the worker recovers or the job "
        "ends.",
        actions=(
            "Note the worker's node and GPU: the Nodes dashboard says whether that "
            "machine straggles in other jobs too.",
            "Act on the diagnosis' advice when its saving outweighs a restart; else let it "
            "run and watch the cost grow.",
        ),
        severity="ticket",
    ),
    AlertRule(
        uid="lagscope-job-silent",
        title="Job silent",
        # A job whose every rank said it ended (its monitors closed) finished, or raised
        # through them: not silent. One that hangs, is killed or never closes its
        # monitors says nothing, and pages.
        sql=f"""
            SELECT job_id, toString(attempt) AS attempt,
                   toFloat64(dateDiff('second', max(ts), now())) AS value
            FROM steps FINAL
            WHERE ts >= now() - INTERVAL 1 HOUR AND (job_id, attempt) NOT IN {ENDED_JOBS}
            GROUP BY job_id, attempt
        """,
        threshold=float(SILENT_AFTER_S),
        kind="gt",
        summary="No step of job {{ $labels.job_id }} (attempt {{ $labels.attempt }}) for "
        "{{ $values.A }} s, and its ranks did not say they ended: the job stalled, "
        "crashed, or its data stopped arriving.",
        dashboard_uid=PIPELINE_HEALTH_UID,
        # Panels with data only: ops still arriving (the job runs, the analysis is stuck),
        # steps still closing, how far behind the stored steps are, and whether the
        # workers fall behind Kafka (their metric, through Prometheus).
        next_panels=(
            "Ingest rate: ops per minute",
            "Steps analysed per minute",
            "Sink latency (processed_at - ts)",
            "Kafka consumer lag per partition",
        ),
        fires_when=f"a job that reported in the last hour has sent no step for "
        f"{SILENT_AFTER_S // 60} minutes, and not every rank of it said it ended",
        description="The job hung, was killed, or its data stopped arriving (the sidecar, "
        "Kafka, the workers). A job that finished stays quiet: its ranks' monitors say "
        "so.",
        actions=(
            "Ops still arriving but no steps: the analysis is stuck; 'Kafka consumer lag "
            "per partition' and the workers' pods (LagscopeWorkerDown, liveness restarts).",
            "Nothing arriving: the job itself (its scheduler's status, its logs), then its "
            "streamer (`kubectl logs` of the sidecar or the node's DaemonSet pod).",
        ),
    ),
    AlertRule(
        uid="lagscope-rank-silent",
        title="Rank silent",
        sql=f"""
            SELECT job_id, toString(attempt) AS attempt, toString(missing_rank) AS rank,
                   toFloat64(count()) AS value
            FROM steps FINAL
            ARRAY JOIN missing_ranks AS missing_rank
            WHERE ts >= now() - INTERVAL 10 MINUTE AND (job_id, attempt) NOT IN {ENDED_JOBS}
            GROUP BY job_id, attempt, missing_rank
        """,
        threshold=RANK_MISSING_STEPS - 0.5,
        kind="gt",
        summary="Rank {{ $labels.rank }} of job {{ $labels.job_id }} was missing from "
        "{{ $values.A }} steps in 10 minutes.",
        dashboard_uid=PIPELINE_HEALTH_UID,
        next_panels=("Incomplete steps and their missing ranks", "Late or incomplete steps"),
        fires_when=f"one rank was missing from {RANK_MISSING_STEPS} or more steps in 10 minutes",
        description="That rank's batches stop arriving while the others' do: its sidecar "
        "or log stopped, or the rank itself is stuck while the others wait.",
        actions=(
            "Find the rank's node (the job overview's worker panels, or the rank identity) "
            "and its streamer's log there.",
            "The streamer ships and the rank writes nothing: the rank is stuck; the job's owners.",
        ),
    ),
    AlertRule(
        uid="lagscope-mfu-below-baseline",
        title="MFU below the job's baseline",
        sql=f"""
            SELECT job_id, toString(attempt) AS attempt,
                   avgIf(assumeNotNull(mfu_actual), ts >= now() - INTERVAL 10 MINUTE)
                   / quantile(0.9)(assumeNotNull(mfu_actual)) AS value
            FROM steps FINAL
            WHERE isFinite(mfu_actual) AND ts >= now() - INTERVAL 1 DAY
              AND (job_id, attempt) NOT IN {ENDED_JOBS}
            GROUP BY job_id, attempt
            HAVING countIf(ts >= now() - INTERVAL 10 MINUTE) > 0
        """,
        threshold=MFU_FRACTION_OF_BASELINE,
        kind="lt",
        summary="MFU of job {{ $labels.job_id }} is {{ $values.A }} of what the same "
        "attempt reaches on a good stretch (its 90th percentile).",
        dashboard_uid=JOB_OVERVIEW_UID,
        next_panels=("MFU: actual vs straggler-free", "Slowdown S per step"),
        fires_when=f"MFU of the last 10 minutes is below {MFU_FRACTION_OF_BASELINE:.0%} of "
        "the attempt's own 90th percentile",
        description="The job runs well below what it reached earlier, straggler or not "
        "(a slower phase of training, the input pipeline, a degraded machine).",
        actions=(
            "Straggler-free MFU low too: the whole job slowed (data, network, a phase of "
            "training); the job's owners.",
            "Only the actual MFU low: a straggler; read its episode.",
        ),
        severity="ticket",
    ),
    AlertRule(
        uid="lagscope-dead-letters-rising",
        title="Dead letters rising",
        sql="""
            SELECT job_id, toString(source) AS source,
                   toFloat64(countIf(ts >= now() - INTERVAL 10 MINUTE)
                             - countIf(ts < now() - INTERVAL 10 MINUTE)) AS value
            FROM dead_letters FINAL
            WHERE ts >= now() - INTERVAL 20 MINUTE
            GROUP BY job_id, source
        """,
        threshold=0.0,
        kind="gt",
        summary="More input was rejected in the last 10 minutes than in the 10 before "
        "(source {{ $labels.source }}, job {{ $labels.job_id }}).",
        dashboard_uid=PIPELINE_HEALTH_UID,
        next_panels=("Dead letters by reason", "Latest dead letters"),
        fires_when="more input was rejected in the last 10 minutes than in the 10 before",
        description="A producer writes bad records or a log is being corrupted: data is "
        "being set aside (each dead letter names its node, file and offset).",
        actions=(
            "Group by reason: a newer record version (upgrade the workers, deploy/README.md "
            "'Upgrade and rollback'), torn records (a disk or a killed writer), "
            "undecodable batches.",
        ),
        severity="ticket",
    ),
)


def rule_group(grafana_url: str = "") -> alerting_model.RuleGroup:
    """Every rule, in one group evaluated every minute (`grafana_url`: where the runbook
    links point; "" links relative to the Grafana that shows the alert)."""
    group = (
        alerting.RuleGroup(RULE_GROUP)
        .folder_uid(FOLDER_UID)
        .interval(EVALUATION_INTERVAL)
        .rules([rule.builder(grafana_url) for rule in RULES])
    )
    return group.build()


def rule_group_dict(grafana_url: str = "") -> dict[str, Any]:
    """The rule group as the alerting provisioning API takes it (PUT .../rule-groups/...)."""
    return json.loads(json.dumps(rule_group(grafana_url), cls=JSONEncoder))


def provisioning_file() -> str:
    """Grafana's alerting file-provisioning document (`apiVersion: 1`, `groups`), as JSON
    (YAML's superset: Grafana reads it from provisioning/alerting/)."""
    group = rule_group_dict()
    document = {
        "apiVersion": 1,
        "groups": [
            {
                "orgId": 1,
                "name": group["title"],
                "folder": FOLDER_UID,
                "interval": group["interval"],
                "rules": [
                    {
                        key: rule[key]
                        for key in (
                            "uid",
                            "title",
                            "condition",
                            "data",
                            "noDataState",
                            "execErrState",
                            "for",
                            "annotations",
                            "labels",
                        )
                        if key in rule
                    }
                    for rule in group["rules"]
                ],
            }
        ],
    }
    return json.dumps(document, indent=2, sort_keys=True) + "\n"
