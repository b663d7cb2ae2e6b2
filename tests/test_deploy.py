"""deploy/: the compose file validates against the Compose Specification schema, the
Kubernetes manifests against the Kubernetes API schemas (kubernetes-validate), and every
image, port, environment variable, CLI command and flag, and volume they name exists in the
code or configuration it points to.

No Docker daemon or `docker compose` plugin is available on the test machines, hence the
schema: tests/data/compose_spec.json is `compose/config/compose_spec.json` of the
docker-compose 1.29.2 distribution on PyPI (Apache-2.0).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from lagscope import __version__
from lagscope.cli import build_parser
from lagscope.producers.config import LagscopeConfig
from lagscope.store.dsn import DSN_ENV, parse_dsn

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
K8S_VERSION = "1.30"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _k8s_documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _images() -> dict[str, dict[str, str]]:
    """The kustomization's images, by the name the manifests use."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return {image["name"]: image for image in kustomization["images"]}


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    pod = spec.get("spec", {})
    if "template" in pod:
        pod = pod["template"]["spec"]
    return pod.get("containers", []) + pod.get("initContainers", [])


# -- schemas ------------------------------------------------------------------------------


def test_compose_file_matches_the_compose_spec(compose: dict[str, Any]) -> None:
    schema = json.loads((REPO / "tests" / "data" / "compose_spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


@pytest.mark.parametrize(
    "name,doc", _k8s_documents(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_k8s_manifest_matches_the_api_schema(name: str, doc: dict[str, Any]) -> None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{name} ({doc['kind']}): {exc.message} at {list(exc.path)}")


def test_kustomization_lists_existing_files() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource
    assert kustomization["namespace"] == "lagscope"
    # the image names the manifests use are the ones kustomize rewrites
    images = _images()
    assert set(images) == {"lagscope-worker", "lagscope-sidecar"}
    for name, doc in _k8s_documents():
        if name in kustomization["resources"]:
            for container in _containers(doc):
                assert container["image"] in images, (name, container["name"])


# -- cross-checks against the code ---------------------------------------------------------


def _lagscope_commands(compose: dict[str, Any]) -> list[tuple[str, list[str]]]:
    found = []
    for service, spec in compose["services"].items():
        command = spec.get("command")
        if command:
            argv = shlex.split(command) if isinstance(command, str) else list(command)
            found.append((f"compose service {service}", argv))
    for name, doc in _k8s_documents():
        for container in _containers(doc):
            argv = container.get("command", []) + container.get("args", [])
            if argv and argv[0] == "lagscope":
                found.append((f"{name} container {container['name']}", argv))
    return found


def test_cli_commands_and_flags_exist(compose: dict[str, Any]) -> None:
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if a.dest == "command"]
    commands = _lagscope_commands(compose)
    assert {argv[1] for _, argv in commands} >= {"worker", "stream", "replay"}
    for where, argv in commands:
        assert argv[0] == "lagscope", where
        assert argv[1] in subparsers.choices, f"{where}: no command `lagscope {argv[1]}`"
        try:
            args = parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"{where}: `{shlex.join(argv)}` is rejected by the CLI parser")
        assert args.command == argv[1]


def _config_env_is_read(name: str) -> bool:
    """True if the environment variable is read by producers.config or the sink."""
    if name in (DSN_ENV, "LAGSCOPE_CONFIG"):
        return True
    if not name.startswith("LAGSCOPE_") or "__" not in name:
        return False
    section, _, field = name.removeprefix("LAGSCOPE_").lower().partition("__")
    model = LagscopeConfig.model_fields.get(section)
    return model is not None and field in model.annotation.model_fields


def _lagscope_env(compose: dict[str, Any]) -> list[tuple[str, str, str]]:
    found = []
    for service, spec in compose["services"].items():
        for key, value in (spec.get("environment") or {}).items():
            found.append((f"compose {service}", key, str(value)))
    for name, doc in _k8s_documents():
        if doc["kind"] == "ConfigMap":
            found += [(name, key, str(value)) for key, value in doc["data"].items()]
        for container in _containers(doc):
            for item in container.get("env", []):
                found.append((name, item["name"], str(item.get("value", ""))))
    return [f for f in found if f[1].startswith("LAGSCOPE_")]


def test_env_vars_are_read_by_the_config_model(compose: dict[str, Any]) -> None:
    env = _lagscope_env(compose)
    assert {key for _, key, _ in env} >= {DSN_ENV, "LAGSCOPE_KAFKA__BOOTSTRAP_SERVERS"}
    for where, key, _ in env:
        if key == "LAGSCOPE_TRACES":  # compose-only interpolation variable
            continue
        assert _config_env_is_read(key), f"{where}: nothing reads {key}"
    # the Kafka address the containers use is a listener the broker advertises
    kafka_env = compose["services"]["kafka"]["environment"]
    advertised = kafka_env["KAFKA_ADVERTISED_LISTENERS"]
    for where, key, value in env:
        if key == "LAGSCOPE_KAFKA__BOOTSTRAP_SERVERS" and where.startswith("compose"):
            assert f"//{value}" in advertised, (where, value)


def test_ports_match_the_defaults(compose: dict[str, Any]) -> None:
    from lagscope.producers.config import KafkaSettings

    services = compose["services"]
    host_kafka_port = KafkaSettings().bootstrap_servers.rsplit(":", 1)[1]
    assert f"{host_kafka_port}:{host_kafka_port}" in services["kafka"]["ports"]
    assert (
        "EXTERNAL://localhost:" + host_kafka_port
        in (services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"])
    )
    # the workers' DSN names the ClickHouse service, its HTTP port and the database the
    # server creates for the writer user
    dsn = services["worker"]["environment"][DSN_ENV]
    parsed = parse_dsn(re.sub(r"\$\{[^}]*\}", "pw", dsn))
    ch_env = services["clickhouse"]["environment"]
    assert parsed.kind == "http" and parsed.database == ch_env["CLICKHOUSE_DB"]
    assert "@clickhouse:8123/" in dsn and "8123:8123" in services["clickhouse"]["ports"]
    assert dsn.startswith(f"http://{ch_env['CLICKHOUSE_USER']}:")
    # the data source Grafana provisions reaches the same server the same way
    provisioned = yaml.safe_load(
        (REPO / "dashboards/provisioning/datasources/lagscope-clickhouse.yaml").read_text()
    )["datasources"][0]
    grafana_env = services["grafana"]["environment"]
    filled = {
        key: re.sub(r"\$\{(\w+)\}", lambda m: str(grafana_env[m.group(1)]), str(value))
        for key, value in provisioned["jsonData"].items()
    }
    assert filled["protocol"] == "http" and filled["secure"] == "false"
    assert filled["host"] == "clickhouse" and filled["port"] == "8123"
    assert "3000:3000" in services["grafana"]["ports"]


def test_images_exist_and_match_pinned_versions(compose: dict[str, Any]) -> None:
    from lagscope.deploy.kafka_local import KAFKA_VERSION

    services = compose["services"]
    assert services["kafka"]["image"] == f"apache/kafka:{KAFKA_VERSION}"
    # Grafana's line is the one the dashboards SDK is pinned to
    pyproject = (REPO / "pyproject.toml").read_text()
    sdk_line = re.search(r"grafana-foundation-sdk==\d+!(\d+\.\d+)\.", pyproject).group(1)
    assert services["grafana"]["image"].startswith(f"grafana/grafana:{sdk_line}.")
    assert (
        "grafana-clickhouse-datasource" in services["grafana"]["environment"]["GF_INSTALL_PLUGINS"]
    )
    for name, target in (("worker", "worker"), ("replay", "tools")):
        build = services[name]["build"]
        dockerfile = (DEPLOY / build["context"] / build["dockerfile"]).resolve()
        assert dockerfile.is_file()
        assert f" AS {target}\n" in dockerfile.read_text()
        assert build["target"] == target
    dockerfile_text = (DEPLOY / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (.+) \S+$", dockerfile_text, flags=re.M):
        for item in source.split():
            assert (REPO / item).exists(), f"Dockerfile copies missing {item}"


def test_volumes_and_provisioning_agree(compose: dict[str, Any]) -> None:
    services = compose["services"]
    mounts: dict[str, str] = {}
    for service in ("grafana", "clickhouse"):
        for volume in services[service]["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{service}: {source} does not exist"
                mounts[target] = source
    provider = yaml.safe_load(
        (REPO / "dashboards/provisioning/dashboards/lagscope.yaml").read_text()
    )["providers"][0]
    assert mounts[provider["options"]["path"]] == "../dashboards/generated"
    assert mounts["/etc/grafana/provisioning"] == "../dashboards/provisioning"

    # the provisioning file's ${VAR}s are exactly what the Grafana service sets
    datasource_text = (
        REPO / "dashboards/provisioning/datasources/lagscope-clickhouse.yaml"
    ).read_text()
    datasource = yaml.safe_load(datasource_text)["datasources"][0]
    placeholders = set(re.findall(r"\$\{(\w+)\}", json.dumps(datasource)))
    grafana_env = services["grafana"]["environment"]
    assert placeholders <= set(grafana_env)
    # ... and match the read-only user ClickHouse defines
    users = ET.parse(DEPLOY / "clickhouse/users.d/grafana-readonly.xml").getroot()
    user = users.find(f"users/{grafana_env['CLICKHOUSE_GRAFANA_USER']}")
    assert user is not None
    password_env = user.find("password").get("from_env")
    assert password_env in services["clickhouse"]["environment"]
    profile = users.find(f"profiles/{user.findtext('profile')}")
    assert profile.findtext("readonly") in ("1", "2")
    grant = user.findtext("grants/query")
    assert grant == f"GRANT SELECT ON {grafana_env['CLICKHOUSE_DATABASE']}.*"


def test_env_example_defines_every_required_secret(compose: dict[str, Any]) -> None:
    required = set(re.findall(r"\$\{(\w+):\?", COMPOSE_FILE.read_text()))
    example = (DEPLOY / ".env.example").read_text()
    defined = set(re.findall(r"^(\w+)=", example, flags=re.M))
    assert required and required <= defined
    assert "deploy/.env" in (REPO / ".gitignore").read_text().splitlines()


def test_k8s_config_and_secret_references_resolve() -> None:
    docs = _k8s_documents()
    config_maps = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "ConfigMap"}
    secrets = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Secret"}
    for name, doc in docs:
        for container in _containers(doc):
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps, name
            for item in container.get("env", []):
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["stringData"], name
                    assert item["name"] == DSN_ENV
    for config_map in config_maps.values():
        for key in config_map["data"]:
            assert _config_env_is_read(key), f"ConfigMap key {key} is read by nothing"


# -- issue 27: versions, probes and metrics, priority, state, logs that outlive a pod -------


def _k8s(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _workload(name: str, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _k8s(name) if d["kind"] == kind]
    return doc


def _flag(argv: list[str], flag: str) -> str:
    assert flag in argv, (flag, argv)
    return argv[argv.index(flag) + 1]


def test_image_and_manifests_are_on_the_package_version(compose: dict[str, Any]) -> None:
    for image in _images().values():
        assert image["newTag"] == __version__
    assert compose["services"]["worker"]["image"] == f"lagscope-worker:{__version__}"
    assert compose["services"]["replay"]["image"] == f"lagscope:{__version__}"
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    label = re.search(r'org\.opencontainers\.image\.version="([^"]+)"', dockerfile)
    assert label is not None and label.group(1) == __version__
    # an image named outside the kustomization (the sidecar example) carries the tag itself
    for name, doc in _k8s_documents():
        for container in _containers(doc):
            image = container["image"]
            if image not in _images() and image.rpartition("/")[2].startswith("lagscope"):
                assert image.endswith(f":{__version__}"), (name, container)


@pytest.mark.parametrize(
    "name,kind",
    [
        ("worker-deployment.yaml", "Deployment"),
        ("streamer-daemonset.yaml", "DaemonSet"),
        ("streamer-sidecar-example.yaml", "Pod"),
    ],
)
def test_worker_and_streamer_expose_metrics_and_are_probed(name: str, kind: str) -> None:
    doc = _workload(name, kind)
    pod = doc["spec"].get("template", doc)
    (container,) = [c for c in _containers(pod) if c.get("command", [""])[0] == "lagscope"]
    port = int(_flag(container["command"], "--metrics-port"))
    (declared,) = [p for p in container["ports"] if p["name"] == "metrics"]
    assert declared["containerPort"] == port
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port
    assert annotations["prometheus.io/path"] == "/metrics"
    probes = [k for k in ("livenessProbe", "readinessProbe", "startupProbe") if k in container]
    assert "livenessProbe" in probes
    if kind != "Pod":  # a long-running service is also taken out of rotation when unready
        assert "readinessProbe" in probes
    # the component's own verdicts, not the metrics thread's answer (producers/metrics.py)
    paths = {"livenessProbe": "/healthz", "startupProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe in probes:
        assert container[probe]["httpGet"] == {"path": paths[probe], "port": "metrics"}


def test_metrics_service_and_service_monitor_select_the_workers() -> None:
    deployment = _workload("worker-deployment.yaml", "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = _workload("worker-metrics-service.yaml", "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "metrics" and port["name"] == "metrics"
    monitors = list(yaml.safe_load_all((K8S / "monitoring" / "servicemonitor.yaml").read_text()))
    by_kind = {m["kind"]: m for m in monitors}
    service_monitor = by_kind["ServiceMonitor"]
    assert service_monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items()
    )
    assert [e["port"] for e in service_monitor["spec"]["endpoints"]] == ["metrics"]
    daemonset = _workload("streamer-daemonset.yaml", "DaemonSet")
    pod_monitor = by_kind["PodMonitor"]
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= (
        daemonset["spec"]["template"]["metadata"]["labels"].items()
    )
    assert [e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


def test_the_streamer_has_a_priority_class_of_its_own_below_the_system_ones() -> None:
    daemonset = _workload("streamer-daemonset.yaml", "DaemonSet")
    name = daemonset["spec"]["template"]["spec"]["priorityClassName"]
    assert not name.startswith("system-")
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    classes = {
        d["metadata"]["name"]: d
        for resource in kustomization["resources"]
        for d in _k8s(resource)
        if d["kind"] == "PriorityClass"
    }
    priority = classes[name]
    # user-defined classes go up to 1e9; the system classes sit at 2e9 and above
    assert 0 < priority["value"] <= 1_000_000_000
    assert priority.get("globalDefault") is False
    assert priority["preemptionPolicy"] == "Never"  # never evicts a training pod


def test_the_image_owns_a_state_directory_that_workers_mount_and_use(
    compose: dict[str, Any],
) -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^USER 10001$", dockerfile, flags=re.M)
    assert "mkdir -p /var/lib/lagscope" in dockerfile
    assert "chown 10001:10001 /var/lib/lagscope" in dockerfile
    assert re.findall(r"^WORKDIR (\S+)$", dockerfile, flags=re.M)[-1] == "/var/lib/lagscope"
    state = "/var/lib/lagscope"

    worker = compose["services"]["worker"]
    assert _flag(worker["command"], "--data-dir").startswith(state + "/")
    # one volume per replica (scaled workers must not share a state directory)
    assert state in worker["volumes"]

    deployment = _workload("worker-deployment.yaml", "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert _flag(container["command"], "--data-dir").startswith(state + "/")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == state]
    assert not mount.get("readOnly", False)
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume
    assert pod["securityContext"]["runAsUser"] == 10001


def test_the_sidecar_example_keeps_its_logs_beyond_the_pod() -> None:
    docs = _k8s("streamer-sidecar-example.yaml")
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    (streamer,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "lagscope-streamer"]
    log_dir = _flag(streamer["command"], "--log-dir")
    (mount,) = [m for m in streamer["volumeMounts"] if m["mountPath"] == log_dir]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" not in volume
    assert volume["persistentVolumeClaim"]["claimName"] in claims
    # the example says what happens to the logs when Kafka is down at the end
    text = (K8S / "streamer-sidecar-example.yaml").read_text()
    assert "exits 1" in text and "outlives the pod" in text


# -- issue 67: the manifests as kustomize renders them, run against the real CLI ----------


def _kustomize() -> Path:
    """The kustomize the project pins (Makefile: KUSTOMIZE_VERSION, built by `make
    install` into the virtual environment); its absence fails, never skips."""
    version = re.search(r"^KUSTOMIZE_VERSION := (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert version is not None
    binary = Path(sys.executable).parent / "kustomize"
    stamp = Path(sys.executable).parent.parent / f".kustomize-{version.group(1)}"
    assert binary.is_file() and stamp.is_file(), (
        f"kustomize {version.group(1)} is not built: run `make kustomize`"
    )
    return binary


def _render(folder: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [str(_kustomize()), "build", str(folder)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec = doc["spec"]
    return spec["template"]["spec"] if "template" in spec else spec


def _parsed(parser: Any, argv: list[str], where: str) -> Any:
    """argv through the real CLI parser: every flag must exist and take its value."""
    assert argv[0] == "lagscope", where
    try:
        return parser.parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"{where}: `{shlex.join(argv)}` is rejected by the CLI parser")


def _node_name_env(container: dict[str, Any]) -> dict[str, Any] | None:
    found = [e for e in container.get("env", []) if e["name"] == "NODE_NAME"]
    return found[0]["valueFrom"] if found else None


def test_the_rendered_manifests_run_the_real_cli() -> None:
    """What `kubectl apply -k deploy/k8s` creates, as the pinned kustomize renders it:
    namespaced, on the package's images, each lagscope container's command a command line
    the CLI accepts, and the streamers set up to keep every record."""
    parser = build_parser()
    rendered = _render(K8S)
    kinds = [d["kind"] for d in rendered]
    # the namespace first: everything else lives in it
    assert kinds[0] == "Namespace" and rendered[0]["metadata"]["name"] == "lagscope"
    commands = {}
    for doc in rendered:
        if doc["kind"] not in ("Namespace", "PriorityClass"):
            assert doc["metadata"]["namespace"] == "lagscope", doc["metadata"]["name"]
        if doc["kind"] not in ("Deployment", "DaemonSet"):
            continue
        for container in _containers(doc):
            registry, _, tag = container["image"].rpartition(":")
            assert registry.startswith("registry.example.com/lagscope-") and tag == __version__
            argv = container["command"] + container.get("args", [])
            if argv[0] == "lagscope":
                where = f"{doc['kind']} {doc['metadata']['name']}"
                commands[doc["kind"]] = (_parsed(parser, argv, where), container, doc)
    worker_args, _, _ = commands["Deployment"]
    assert worker_args.command == "worker" and worker_args.log_level == "info"
    stream_args, streamer, daemonset = commands["DaemonSet"]
    # the node's disk: what Kafka confirmed is deleted, so the logs must be writable
    assert stream_args.delete_shipped is True
    log_mount = [m for m in streamer["volumeMounts"] if m["mountPath"] == stream_args.log_dir]
    assert not log_mount[0].get("readOnly", False)
    assert _node_name_env(streamer) == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert stream_args.idle_exit_s is None and stream_args.exit_after_job_end_s is None
    assert daemonset["spec"]["template"]["spec"]["priorityClassName"] == "lagscope-node-agent"


def test_the_sidecar_example_is_a_native_sidecar_that_drains_before_it_exits() -> None:
    parser = build_parser()
    (pod,) = [d for d in _k8s("streamer-sidecar-example.yaml") if d["kind"] == "Pod"]
    spec = _pod_spec(pod)
    (sidecar,) = spec["initContainers"]
    # a native sidecar: started before the trainer, stopped (SIGTERM) after it exited
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/healthz"
    args = _parsed(parser, sidecar["command"], "sidecar")
    assert args.command == "stream"
    # SIGTERM ships to the end, inside the pod's grace period
    assert 0 < args.drain_s < spec["terminationGracePeriodSeconds"]
    # no self-exit on a native sidecar (it would be restarted), and none on a quiet job
    assert args.idle_exit_s is None and args.exit_after_job_end_s is None
    for container in [sidecar, *spec["containers"]]:
        assert _node_name_env(container) == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    text = (K8S / "streamer-sidecar-example.yaml").read_text()
    # the fallback for clusters without native sidecars is a command the CLI takes too
    assert "--exit-after-job-end-s 60" in text
    _parsed(parser, [*sidecar["command"][:-2], "--exit-after-job-end-s", "60"], "fallback")


def test_the_monitoring_kustomization_renders() -> None:
    rendered = _render(K8S / "monitoring")
    assert sorted(d["kind"] for d in rendered) == ["PodMonitor", "PrometheusRule", "ServiceMonitor"]
    assert all(d["metadata"]["namespace"] == "lagscope" for d in rendered)


# -- the runbook, as an operator follows it on an empty cluster ----------------------------


def _runbook_section(title: str) -> str:
    text = (DEPLOY / "README.md").read_text()
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_the_runbook_works_in_order_from_an_empty_cluster() -> None:
    steps = _runbook_section("Kubernetes from an empty cluster")
    order = [
        "docker push $REGISTRY/lagscope-sidecar",
        "kubectl apply -f deploy/k8s/namespace.yaml",
        "kafka-topics.sh",
        "CREATE USER IF NOT EXISTS grafana",
        "kubectl -n lagscope create secret generic lagscope-clickhouse",
        "kubectl apply -k deploy/k8s\n",
        "kubectl apply -k deploy/k8s/monitoring",
        "lagscope dashboards push",
    ]
    images = _runbook_section("Images")
    positions = [(images + steps).index(what) for what in order]
    assert positions == sorted(positions), "the runbook's steps are out of order"
    # every image the manifests name is built and pushed, every path it applies exists
    for name in _images():
        assert f"--target {name.removeprefix('lagscope-')} -t $REGISTRY/{name}:" in images
        assert f"docker push $REGISTRY/{name}:" in images
    for path in re.findall(r"kubectl apply -[fk] (deploy/\S+)", steps):
        assert (REPO / path).exists(), path
    # the topics the workers and streamers use, each with its partitions
    config = yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]
    topics = [config[k] for k in config if k.startswith("LAGSCOPE_KAFKA__TOPIC_")]
    for topic in [*topics, "lagscope.results"]:
        assert re.search(rf"--topic {re.escape(topic)} \\\s+--partitions \d+", steps), topic
    assert "cleanup.policy=compact" in steps.split("--topic lagscope.jobs", 1)[1][:120]
    # Grafana's user is the read-only one compose defines, and the secret is the one the
    # workers read
    users = ET.parse(DEPLOY / "clickhouse/users.d/grafana-readonly.xml").getroot()
    readonly = users.findtext("profiles/grafana_readonly/readonly")
    assert f"readonly = {readonly}" in steps and "GRANT SELECT ON lagscope.* TO grafana" in steps
    deployment = _workload("worker-deployment.yaml", "Deployment")
    (ref,) = [
        e["valueFrom"]["secretKeyRef"]
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        if "valueFrom" in e
    ]
    assert f"secret generic {ref['name']} \\\n       --from-literal={ref['key']}=" in steps


def test_the_runbook_says_how_to_upgrade_and_roll_back_and_keeps_no_diary() -> None:
    upgrade = _runbook_section("Upgrade and rollback")
    assert upgrade.index("lagscope-worker=$REGISTRY/lagscope-worker:$NEW") < upgrade.index(
        "lagscope-sidecar=$REGISTRY/lagscope-sidecar:$NEW"
    )  # readers first
    assert upgrade.index("lagscope-sidecar=$REGISTRY/lagscope-sidecar:$OLD") < upgrade.index(
        "lagscope-worker=$REGISTRY/lagscope-worker:$OLD"
    )  # and back in the reverse order
    text = (DEPLOY / "README.md").read_text()
    # the dated benchmark diary lives with the benchmarks
    assert not re.search(r"20\d\d-\d\d-\d\d", text)
    notes = (REPO / "tests" / "bench" / "NOTES.md").read_text()
    assert (
        "tests/bench/NOTES.md" in text and "tests/bench/NOTES.md" in (REPO / "Makefile").read_text()
    )
    assert len(re.findall(r"20\d\d-\d\d-\d\d", notes)) > 10


def test_compose_prometheus_scrapes_the_workers_the_lag_panel_and_rules_expect(
    compose: dict[str, Any],
) -> None:
    from lagscope.dashboards.pipeline_health import PROMETHEUS_DATASOURCE_UID
    from lagscope.dashboards.prometheus_rules import WORKER_JOB

    services = compose["services"]
    (config_mount,) = [v for v in services["prometheus"]["volumes"] if "prometheus.yml" in v]
    config = yaml.safe_load((DEPLOY / config_mount.split(":")[0]).read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == WORKER_JOB
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["worker"] and "worker" in services
    assert str(sd["port"]) == _flag(services["worker"]["command"], "--metrics-port")
    # Grafana provisions a Prometheus data source on it, the one the lag panel starts on
    provisioned = yaml.safe_load(
        (REPO / "dashboards/provisioning/datasources/lagscope-prometheus.yaml").read_text()
    )["datasources"][0]
    assert provisioned["uid"] == PROMETHEUS_DATASOURCE_UID
    grafana_env = services["grafana"]["environment"]
    url = re.sub(r"\$\{(\w+)\}", lambda m: str(grafana_env[m.group(1)]), provisioned["url"])
    assert url == f"http://prometheus:{services['prometheus']['ports'][0].split(':')[1]}"
