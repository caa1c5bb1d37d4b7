"""deploy/ is tested as far as a machine without a container engine can: every file parses, every
variable it sets is a real setting (and the ConfigMap carries every setting), every command, port and
path it names is the service's own, the Dockerfile installs the way the README says, and every metric
the alerts and the dashboard query is one the service serves."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient

from service.__main__ import build_parser
from service.settings import Settings, setting_docs

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SETTINGS = {name for name, _, _ in setting_docs()}
# Secrets are never in a ConfigMap: the Deployment reads them from a Secret.
SECRETS = {"QS_ADMIN_TOKEN"}
# Metrics that come from redis_exporter, not from the service.
EXPORTER_METRICS = {"redis_up"}


def yaml_docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def k8s_docs() -> dict[str, Any]:
    docs = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml_docs(path):
            docs[doc["kind"]] = doc
    return docs


def compose() -> dict[str, Any]:
    doc = yaml_docs(DEPLOY / "compose.yaml")[0]
    assert isinstance(doc, dict)
    return doc


def container(docs: dict[str, Any]) -> dict[str, Any]:
    containers = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def subcommands() -> set[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return set(action.choices)  # type: ignore[arg-type]


def dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text()


def test_every_yaml_and_json_file_in_deploy_parses() -> None:
    yamls = sorted(DEPLOY.rglob("*.yaml"))
    assert len(yamls) >= 7
    for path in yamls:
        assert yaml_docs(path), path
    dashboard = json.loads((DEPLOY / "grafana" / "dashboard.json").read_text())
    assert dashboard["panels"]


def test_kubernetes_manifests_have_every_required_kind() -> None:
    kinds = set(k8s_docs())
    assert kinds == {
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    }


def test_configmap_carries_every_setting_but_secrets_and_nothing_else() -> None:
    data = k8s_docs()["ConfigMap"]["data"]
    assert set(data) == SETTINGS - SECRETS
    for value in data.values():
        assert isinstance(value, str), "ConfigMap values must be strings"


def test_every_variable_the_deploy_files_set_is_a_setting() -> None:
    seen: set[str] = set()
    for service in compose()["services"].values():
        seen |= set(service.get("environment", {}))
    seen |= {env["name"] for env in container(k8s_docs()).get("env", [])}
    unit = (DEPLOY / "systemd" / "question-service.service").read_text()
    seen |= set(re.findall(r"^Environment=(QS_\w+)=", unit, re.MULTILINE))
    seen |= set(re.findall(r"\b(QS_\w+)=", dockerfile()))
    assert seen
    assert seen <= SETTINGS


def test_secrets_come_from_a_secret_not_from_plain_values() -> None:
    env = {e["name"]: e for e in container(k8s_docs())["env"]}
    for name in SECRETS:
        assert "secretKeyRef" in env[name]["valueFrom"]


def test_commands_the_deploy_files_run_are_real_subcommands() -> None:
    known = subcommands()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "question-service" in scripts
    services = compose()["services"]
    assert services["service"]["command"] == ["serve"]
    assert services["worker"]["command"] == ["worker"]
    assert container(k8s_docs())["args"][0] in known
    entrypoint = re.search(r"^ENTRYPOINT (.+)$", dockerfile(), re.MULTILINE)
    cmd = re.search(r"^CMD (.+)$", dockerfile(), re.MULTILINE)
    assert entrypoint is not None
    assert cmd is not None
    assert json.loads(entrypoint.group(1)) == ["question-service"]
    assert json.loads(cmd.group(1))[0] in known
    unit = (DEPLOY / "systemd" / "question-service.service").read_text()
    exec_start = re.search(r"^ExecStart=(.+)$", unit, re.MULTILINE)
    assert exec_start is not None
    program, command = shlex.split(exec_start.group(1))
    assert program.endswith("/question-service")
    assert command in known


def test_ports_are_the_services_own() -> None:
    port = Settings().port
    docs = k8s_docs()
    ports = container(docs)["ports"]
    assert [p["containerPort"] for p in ports] == [port]
    assert docs["ConfigMap"]["data"]["QS_PORT"] == str(port)
    assert f"EXPOSE {port}" in dockerfile()
    assert f"127.0.0.1:{port}/healthz" in dockerfile()
    assert compose()["services"]["service"]["ports"] == [f"{port}:{port}"]


def test_pods_keep_serving_while_their_endpoint_is_removed_within_the_grace_period() -> None:
    """Endpoints are removed asynchronously: without a pause before SIGTERM, connections that
    kube-proxy still routes here are refused. The pause must leave the shutdown its own time."""
    deployment = k8s_docs()["Deployment"]["spec"]["template"]["spec"]
    command = container(k8s_docs())["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pause = int(command[1])
    assert 1 <= pause <= deployment["terminationGracePeriodSeconds"] - 20


def test_redis_conf_keeps_questions_and_sends_expiry_events() -> None:
    lines = {
        tuple(line.split(None, 1))
        for line in (DEPLOY / "redis.conf").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for wanted in [
        ("appendonly", "yes"),
        ("appendfsync", "everysec"),
        ("notify-keyspace-events", "Ex"),
        ("maxmemory-policy", "noeviction"),
    ]:
        assert wanted in lines
    volumes = compose()["services"]["redis"]["volumes"]
    assert any(v.startswith("./redis.conf:") for v in volumes)


def test_dockerfile_copies_what_exists_and_installs_as_the_readme_says() -> None:
    text = dockerfile()
    for copied in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.MULTILINE):
        for path in copied.split():
            assert (ROOT / path).exists(), path
    readme = (ROOT / "README.md").read_text()
    installs = re.findall(r"^RUN (pip .+?)(?: && .*)?$", text, re.MULTILINE)
    assert len(installs) == 2
    for command in installs:
        assert command in readme, f"README does not show the Dockerfile's install step: {command}"
    assert re.search(r"^USER (?!root)\w+", text, re.MULTILINE)
    assert "HEALTHCHECK" in text


def queries() -> list[str]:
    """Every PromQL expression of the alerts and the dashboard."""
    exprs = [
        rule["expr"]
        for group in yaml_docs(DEPLOY / "prometheus" / "alerts.yaml")[0]["groups"]
        for rule in group["rules"]
    ]
    dashboard = json.loads((DEPLOY / "grafana" / "dashboard.json").read_text())
    return exprs + [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]


# Read from Redis at each scrape: every process reports the same value (docs/operations.md).
REDIS_WIDE = (
    "qs_oldest_overdue_pending_seconds",
    "qs_outbox_backlog",
    "qs_pending_questions",
    "qs_deliveries_due",
    "qs_dead_letters",
)


def test_redis_wide_gauges_are_never_summed_over_processes() -> None:
    """A sum over N processes showed N times the real backlog (the dashboard did, for two)."""
    summed = [e for e in queries() for g in REDIS_WIDE if re.search(rf"\bsum\b[^()]*\(\s*{g}\b", e)]
    assert not summed, summed
    assert any(g in e for e in queries() for g in REDIS_WIDE)


def queried_metrics() -> set[str]:
    names = set()
    for expr in queries():
        names |= {m for m in re.findall(r"\b(qs_\w+|redis_\w+)\b", expr)}
    return names


@pytest.mark.redis
async def test_alerts_and_dashboard_query_only_metrics_the_service_serves(
    client: TestClient[object, object],
) -> None:
    reply = await client.get("/metrics")
    assert reply.status == 200
    text = await reply.text()
    served = set(re.findall(r"^# TYPE (\w+) ", text, re.MULTILINE))
    # Histograms and counters are queried through their series names.
    series = served | {f"{n}_{s}" for n in served for s in ("bucket", "sum", "count", "total")}
    missing = queried_metrics() - series - EXPORTER_METRICS
    assert not missing, f"queried but not served: {sorted(missing)}"
    assert {"qs_oldest_overdue_pending_seconds", "qs_redis_errors_total"} <= queried_metrics()
