"""The pipeline's own alerts, on the components' Prometheus metrics: a PrometheusRule for
the Prometheus operator (`deploy/k8s/monitoring/prometheusrule.yaml`, written by
`lagscope dashboards build`). The Grafana rules (`alerts.py`) watch the jobs, through the
store; these watch what carries the data there, where the store cannot see (a worker that
is down stores nothing, and says nothing about it).

| alert | fires when |
|---|---|
| LagscopeWorkerDown | a worker's metrics endpoint has not answered a scrape for 5 minutes |
| LagscopeNoWorker | no worker has been scraped for 5 minutes |
| LagscopeConsumerLagGrowing | an ops partition lags 1,000+ records, growing, for 15 minutes |
| LagscopeStoreFailing | a worker's store has refused writes for 5 minutes |
| LagscopeCheckpointsStale | a worker took records for 15 minutes and wrote no snapshot |
| LagscopeRecordsNeverRead | retention deleted records of the ops topic before a worker read them |
| LagscopeStreamerCannotDeliver | a streamer has held unconfirmed records for 10 minutes |

Job names follow the manifests: the workers' Service `lagscope-worker-metrics` (the
ServiceMonitor's job label), the streamers' PodMonitor `lagscope/lagscope-streamer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lagscope.dashboards.runbook import runbook_url

#: Where `dashboards build` writes the PrometheusRule.
PROMETHEUS_RULE_FILE = (
    Path(__file__).resolve().parent.parent / "deploy" / "k8s" / "monitoring" / "prometheusrule.yaml"
)
#: The job label of the workers' metrics (the Service the ServiceMonitor selects).
WORKER_JOB = "lagscope-worker-metrics"
#: The consumer lag, in records of one partition, under which growth is not paged.
LAG_RECORDS = 1000
#: The Grafana address the runbook links name in alert notifications (set yours, as the
#: image registry in kustomization.yaml).
GRAFANA_URL = "https://grafana.example.com"


@dataclass(frozen=True)
class PrometheusAlert:
    name: str
    expr: str
    for_: str
    severity: Literal["page", "ticket"]
    summary: str
    description: str
    #: What the on-call engineer does, in the order to do it (the runbook's text).
    actions: tuple[str, ...]

    @property
    def anchor(self) -> str:
        return self.name


ALERTS: tuple[PrometheusAlert, ...] = (
    PrometheusAlert(
        name="LagscopeWorkerDown",
        expr=f'up{{job="{WORKER_JOB}"}} == 0',
        for_="5m",
        severity="page",
        summary="lagscope worker {{ $labels.pod }} is down",
        description="Its metrics endpoint has not answered for 5 minutes: the jobs of its "
        "partitions are analysed by nobody until the group gives them to another worker.",
        actions=(
            "`kubectl -n lagscope get pods -l app.kubernetes.io/name=lagscope-worker` and "
            "`kubectl -n lagscope describe pod POD`: OOMKilled (raise the memory limit), "
            "CrashLoopBackOff (`kubectl logs --previous`: a setting, the store), Pending.",
            "A liveness failure restarts it: `kubectl logs` shows the probe's reason line.",
        ),
    ),
    PrometheusAlert(
        name="LagscopeNoWorker",
        expr=f'absent(up{{job="{WORKER_JOB}"}} == 1)',
        for_="5m",
        severity="page",
        summary="No lagscope worker is running",
        description="No worker has answered a scrape for 5 minutes: nothing is analysed, "
        "the ops wait in Kafka (as long as its retention keeps them).",
        actions=(
            "`kubectl -n lagscope get deploy lagscope-worker`: replicas, rollout status.",
            "A rollout stuck on readiness: `kubectl -n lagscope logs deploy/lagscope-worker`.",
        ),
    ),
    PrometheusAlert(
        name="LagscopeConsumerLagGrowing",
        expr=(
            f"sum by (topic, partition) (lagscope_worker_consumer_lag_records) > {LAG_RECORDS}"
            " and sum by (topic, partition) "
            "(deriv(lagscope_worker_consumer_lag_records[10m])) > 0"
        ),
        for_="15m",
        severity="page",
        summary="Partition {{ $labels.partition }} of {{ $labels.topic }} falls behind",
        description="The workers' consumer lag on this partition (one job or a few: the "
        "ops topic is keyed by job) has been above 1,000 records and growing for 15 "
        "minutes: its worker is too slow for its jobs, or stuck.",
        actions=(
            "Pipeline health dashboard, 'Kafka consumer lag per partition': one partition "
            "(a large job on one worker) or all (too few workers).",
            "One partition: turn on the analysis process for large jobs "
            "(LAGSCOPE_PROCESSOR__ANALYSIS_PROCESSES=1, two CPUs per worker).",
            "All partitions: scale the workers (`kubectl -n lagscope scale deploy/"
            "lagscope-worker --replicas N`, at most the topic's partitions).",
        ),
    ),
    PrometheusAlert(
        name="LagscopeStoreFailing",
        expr="max by (pod) (lagscope_worker_store_failing) == 1",
        for_="5m",
        severity="page",
        summary="The store refuses the writes of worker {{ $labels.pod }}",
        description="The worker has held its closed steps in memory for 5 minutes (and "
        "takes no more from Kafka) because ClickHouse refuses its writes. Nothing is lost "
        "yet: the steps are written once the store takes them.",
        actions=(
            "`kubectl -n lagscope logs POD | grep store`: the store's error (auth, disk, "
            "too many parts).",
            "ClickHouse: `SELECT * FROM system.errors ORDER BY last_error_time DESC`, disk "
            "space, the server's log.",
        ),
    ),
    PrometheusAlert(
        name="LagscopeCheckpointsStale",
        expr=(
            "increase(lagscope_worker_records_total[15m]) > 0 "
            "and increase(lagscope_worker_snapshots_total[15m]) == 0"
        ),
        for_="5m",
        severity="ticket",
        summary="Worker {{ $labels.pod }} takes records but writes no snapshot",
        description="It processed records for 15 minutes without one snapshot: its Kafka "
        "offsets are not committed, so a restart reads all of that again.",
        actions=(
            "`kubectl -n lagscope logs POD | grep -i snapshot`: a failing snapshot write.",
            "LagscopeStoreFailing at the same time: the store is the cause.",
        ),
    ),
    PrometheusAlert(
        name="LagscopeRecordsNeverRead",
        expr="increase(lagscope_worker_records_never_read_total[1h]) > 0",
        for_="0m",
        severity="ticket",
        summary="Kafka deleted ops records before worker {{ $labels.pod }} read them",
        description="The workers fell further behind than the ops topic's retention: the "
        "steps of those records are missing or incomplete.",
        actions=(
            "The worker's log names the partition and the offsets skipped.",
            "Raise the ops topic's retention.ms, and look at LagscopeConsumerLagGrowing.",
        ),
    ),
    PrometheusAlert(
        name="LagscopeStreamerCannotDeliver",
        expr=(
            "lagscope_streamer_in_flight_bytes > 0 and "
            "time() - lagscope_streamer_last_checkpoint_timestamp_seconds > 600"
        ),
        for_="5m",
        severity="ticket",
        summary="The streamer on {{ $labels.pod }} has not delivered for 10 minutes",
        description="Records wait unconfirmed and its checkpoint has not moved for 10 "
        "minutes: Kafka does not answer it or refuses its records. The rank logs keep "
        "everything meanwhile (the node's disk fills).",
        actions=(
            "`kubectl -n lagscope logs POD`: 'does not answer' (network, Kafka down) or a "
            "delivery error (topic, ACLs, message size).",
            "The node's free disk under /var/log/lagscope.",
        ),
    ),
)


def prometheus_rule() -> dict[str, Any]:
    """The PrometheusRule resource (monitoring.coreos.com/v1)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "lagscope",
            "namespace": "lagscope",
            "labels": {"app.kubernetes.io/part-of": "lagscope"},
        },
        "spec": {
            "groups": [
                {
                    "name": "lagscope-pipeline",
                    "rules": [
                        {
                            "alert": alert.name,
                            "expr": alert.expr,
                            "for": alert.for_,
                            "labels": {"severity": alert.severity, "team": "lagscope"},
                            "annotations": {
                                "summary": alert.summary,
                                "description": alert.description,
                                "runbook_url": runbook_url(alert.anchor, GRAFANA_URL),
                            },
                        }
                        for alert in ALERTS
                    ],
                }
            ]
        },
    }


def prometheus_rule_file() -> str:
    """The PrometheusRule as YAML."""
    import yaml

    return (
        "# Generated by `lagscope dashboards build` from dashboards/prometheus_rules.py: do "
        "not edit.\n" + yaml.safe_dump(prometheus_rule(), sort_keys=False, width=100)
    )
