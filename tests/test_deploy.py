"""The deployment files, checked without a Docker engine.

- docker-compose.yml and the override files in deploy/ validate against the Compose specification's JSON schema
  (vendored: deploy/schema/, its source in the README there).
- The compose file agrees with itself: the router names every worker replica, Prometheus scrapes every metrics port.
- The Grafana dashboard committed is what `python -m deploy.dashboard` generates now, and every metric it queries is
  one our services export (read from prometheus_client registries: the three metrics modules, and their scrape-time
  collectors over a real cache and a real engine).
- e2e: each of our services' commands, exactly as the compose file spells them, starts and reaches SERVING, and its
  compose healthcheck passes; so a flag renamed in code breaks this test. Mapped to this machine (`Localized`):
  every `--port`, `--metrics-port` and `--http-port` value becomes a free loopback port, a `HOST:PORT` naming a
  compose container becomes 127.0.0.1 and that container's port, `/var/lib/radixserve` (the disk tier's volume)
  becomes a temporary directory, and `python` this interpreter. `--host 0.0.0.0` stays: the transport rules must
  allow it for plaintext without a token.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry

from deploy import dashboard, healthcheck
from radixserve.launch import REPO, Stack, free_port, wait_healthy
from radixserve.server import LAUNCHER_PID_ENV

COMPOSE = REPO / "docker-compose.yml"
SCHEMA = REPO / "deploy" / "schema" / "compose-spec.json"
OURS = ("kvcached", "worker", "router")  # in start order
PORT_FLAGS = ("--port", "--metrics-port", "--http-port")
VOLUME = "/var/lib/radixserve"


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def schema_errors(document: dict) -> list[str]:
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


@pytest.mark.parametrize("path", ["docker-compose.yml", "deploy/compose.ui.yml", "deploy/compose.gpu.yml"])
def test_compose_files_match_the_compose_schema(path):
    assert schema_errors(yaml.safe_load((REPO / path).read_text())) == []


@pytest.mark.parametrize("mistake", [
    lambda c: c["services"]["kvcached"].update(shm_sizes="5gb"),  # an unknown key
    lambda c: c["services"]["worker"]["depends_on"]["kvcached"].update(condition="healthy"),  # not an enum value
    lambda c: c["services"]["router"].update(ports="50051:50051"),  # a string, not a list
])
def test_the_schema_rejects_a_broken_compose_file(mistake):
    broken = compose()
    mistake(broken)
    assert schema_errors(broken)


def flag_values(command: list[str], flag: str) -> list[str]:
    return [value for name, value in itertools.pairwise(command) if name == flag]


def test_the_router_names_every_worker_replica():
    """Compose names replica n `<project>-worker-<n>`; the router must list exactly those (docker-compose.yml)."""
    spec = compose()
    replicas = spec["services"]["worker"]["deploy"]["replicas"]
    (port,) = flag_values(spec["services"]["worker"]["command"], "--port")
    expected = [f"{spec['name']}-worker-{n}:{port}" for n in range(1, replicas + 1)]
    assert flag_values(spec["services"]["router"]["command"], "--worker") == expected


def test_prometheus_scrapes_every_metrics_port():
    """deploy/prometheus.yml's job per service scrapes the `--metrics-port` its compose command sets."""
    services = compose()["services"]
    scraped = {}
    for job in yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())["scrape_configs"]:
        for target in (t for static in job.get("static_configs", []) for t in static["targets"]):
            scraped[job["job_name"]] = target
        for dns in job.get("dns_sd_configs", []):
            (name,) = dns["names"]
            scraped[job["job_name"]] = f"{name}:{dns['port']}"
    assert scraped == {name: f"{name}:{flag_values(services[name]['command'], '--metrics-port')[0]}"
                       for name in OURS}


def test_only_the_router_publishes_ports():
    services = compose()["services"]
    assert {name for name, service in services.items() if "ports" in service} == {"router"}
    assert services["router"]["ports"] == [f"{port}:{port}" for flag in ("--port", "--http-port")
                                           for port in flag_values(services["router"]["command"], flag)]


def test_the_healthcheck_fails_where_nothing_serves():
    assert healthcheck.main([f"127.0.0.1:{free_port()}"]) == 1


def test_the_committed_dashboard_is_generated():
    """Regenerate with `python -m deploy.dashboard` after changing deploy/dashboard.py."""
    assert dashboard.OUTPUT.read_text() == dashboard.render()


SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported(registry) -> set[str]:
    """The sample names a registry's families expose (a counter `x` as `x_total`, a histogram's three series)."""
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES.get(family.type, ("",))}


@pytest.fixture(scope="module")
def our_metrics(tmp_path_factory, tiny_llama_dir) -> set[str]:
    """Every metric our three services export: their modules' metrics (imported into the default registry), and
    what their scrape-time collectors yield over a real KVCache with a disk tier and a real (tiny) engine."""
    import kvcached.metrics
    import model_worker.metrics
    import router.metrics  # noqa: F401 -- registers the router's metrics
    from kvcached.cache import KVCache
    from kvcached.l3 import L3, WritePolicy
    from kvcached.tiers.lmdb_tier import DiskTier
    from tests.engine_helpers import make_engine

    disk = DiskTier(tmp_path_factory.mktemp("l3"), 1 << 24)
    cache = KVCache(1 << 24, 16, 30.0, l3=L3(disk, WritePolicy.WRITE_THROUGH))
    collectors = CollectorRegistry()
    collectors.register(kvcached.metrics.CacheCollector(cache))
    collectors.register(model_worker.metrics.EngineCollector(make_engine(tiny_llama_dir)))
    names = exported(REGISTRY) | exported(collectors)
    disk.close()
    return names


def dashboard_queries() -> list[str]:
    panels = json.loads(dashboard.OUTPUT.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def test_every_dashboard_query_reads_exported_metrics(our_metrics):
    queried = {name for expr in dashboard_queries() for name in re.findall(r"\bradixserve_\w+", expr)}
    assert len(queried) > 30
    assert queried - our_metrics == set()


def test_the_dashboard_covers_the_operators_questions():
    titles = {panel["title"] for panel in json.loads(dashboard.OUTPUT.read_text())["panels"]}
    assert {"Time to first token", "Inter-token latency (mean, derived)", "Token throughput",
            "Prompt tokens served from cache, per tier", "Prefetch wait", "Router queues", "Worker queues",
            "L2 / L3 usage", "Corrupt and rejected pages"} <= titles


@dataclass
class Localized:
    """The compose services' commands mapped onto this machine (see the module docstring)."""

    state_dir: Path
    project: str
    ports: dict[str, dict[str, int]] = field(default_factory=dict)  # container -> its port -> a free loopback port

    def container(self, service: str, replica: int | None) -> str:
        """The name other containers reach it by: the service name, or Compose's name for replica n."""
        return service if replica is None else f"{self.project}-{service}-{replica}"

    def command(self, argv: list[str], container: str) -> list[str]:
        own = self.ports.setdefault(container, {})
        out = []
        for previous, arg in zip([None, *argv[:-1]], argv, strict=True):
            if previous in PORT_FLAGS:
                arg = str(own.setdefault(arg, free_port()))
            elif re.fullmatch(r"[\w.-]+:\d+", arg) and arg.split(":")[0] in self.ports:
                host, port = arg.split(":")
                arg = f"127.0.0.1:{self.ports[host][port]}"
            out.append(arg.replace(VOLUME, str(self.state_dir)))
        return [sys.executable if out[0] == "python" else out[0], *out[1:]]

    def healthcheck(self, test: list[str], container: str) -> list[str]:
        """A `[CMD, ...]` healthcheck, run here: its `127.0.0.1:PORT` is the container's own port."""
        assert test[0] == "CMD"
        own = self.ports[container]
        argv = [re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{own[m.group(1)]}", arg) for arg in test[1:]]
        return [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]


@pytest.mark.e2e
def test_compose_commands_start_and_serve(tmp_path):
    """kvcached, every worker replica (started together) and the router, each as compose spells its command, each
    SERVING on gRPC health and passing its compose healthcheck."""
    spec = compose()
    local = Localized(tmp_path / "volume", spec["name"])
    env = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid())}  # they die with this test (see radixserve.launch)
    with Stack() as stack:
        for service in OURS:
            replicas = spec["services"][service].get("deploy", {}).get("replicas")
            containers = [local.container(service, None)] if replicas is None else \
                [local.container(service, n) for n in range(1, replicas + 1)]
            started = []
            for container in containers:
                argv = local.command(spec["services"][service]["command"], container)
                with open(tmp_path / f"{container}.log", "ab") as log:
                    started.append(subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
                stack.processes.append(started[-1])
            for container, process in zip(containers, started):
                (port,) = flag_values(spec["services"][service]["command"], "--port")
                wait_healthy(f"127.0.0.1:{local.ports[container][port]}", process, timeout_s=120)
                check = local.healthcheck(spec["services"][service]["healthcheck"]["test"], container)
                assert subprocess.run(check, check=False, cwd=REPO, timeout=30).returncode == 0, container
