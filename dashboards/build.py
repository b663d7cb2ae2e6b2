"""What `lagscope dashboards build` writes: one JSON file per dashboard (the fleet-wide
ones and the runbook, which have no job variable, in a folder of their own that Grafana's
file provider reads with the rest), the alert rules' provisioning file and, in a checkout,
the pipeline's PrometheusRule (deploy/k8s/monitoring)."""

from __future__ import annotations

from pathlib import Path

#: Where the built dashboards are committed (and shipped in the wheel).
GENERATED_DIR = Path(__file__).resolve().parent / "generated"


def built_files(out: Path = GENERATED_DIR, alerts_out: Path | None = None) -> dict[Path, str]:
    """Each file a build writes, by path, with its text (`alerts_out`: the alert rules'
    file, by default the provisioning file Grafana loads at start-up)."""
    from lagscope.dashboards.alerts import ALERTS_FILE, provisioning_file
    from lagscope.dashboards.definitions import build_all
    from lagscope.dashboards.fleet import build_fleet
    from lagscope.dashboards.prometheus_rules import PROMETHEUS_RULE_FILE, prometheus_rule_file

    built = {out / f"{name}.json": item.to_json() for name, item in build_all().items()}
    built.update(
        {out / "fleet" / f"{name}.json": item.to_json() for name, item in build_fleet().items()}
    )
    built[alerts_out or ALERTS_FILE] = provisioning_file()
    # The PrometheusRule goes with the repository's manifests: a checkout's own build.
    if out == GENERATED_DIR and PROMETHEUS_RULE_FILE.parent.is_dir():
        built[PROMETHEUS_RULE_FILE] = prometheus_rule_file()
    return built
