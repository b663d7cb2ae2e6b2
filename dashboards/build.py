"""What `lagscope dashboards build` writes: one JSON file per dashboard (the fleet-wide
ones, which have no job variable, in a folder of their own that Grafana's file provider
reads with the rest) and the alert rules' provisioning file."""

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

    built = {out / f"{name}.json": item.to_json() for name, item in build_all().items()}
    built.update(
        {out / "fleet" / f"{name}.json": item.to_json() for name, item in build_fleet().items()}
    )
    built[alerts_out or ALERTS_FILE] = provisioning_file()
    return built
