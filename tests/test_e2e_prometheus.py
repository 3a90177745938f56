"""A real Prometheus server (Debian's `prometheus`, installed by `make system-deps`) scraping a real stack's three
metrics ports on loopback: after a known request sequence, PromQL over the HTTP API gives the L1 hit ratio computed
from the responses' usage, and every query of the Grafana dashboard evaluates.

Skipped where no `prometheus` binary is on PATH (`make test` installs it when it runs as root; see the Makefile).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import requests
import yaml

from deploy import dashboard
from radixserve.launch import LocalServices, free_port, wait_for
from tests.stack import ask, document, generate

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary: make system-deps")]

SCRAPE_INTERVAL = "1s"


def prometheus_config(targets: dict[str, int]) -> dict:
    """deploy/prometheus.yml's jobs (router, kvcached, worker), each scraping `127.0.0.1:<its metrics port>`."""
    return {"global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                               for job, port in targets.items()]}


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    def query(self, expr: str) -> dict:
        """The instant query's `data`; raises on an HTTP or PromQL error."""
        reply = requests.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = reply.json()
        assert reply.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]

    def scalar(self, expr: str) -> float | None:
        """The value of a query that yields one series, None while it yields none."""
        result = self.query(expr)["result"]
        return float(result[0]["value"][1]) if result else None


@pytest.fixture(scope="module")
def metrics_ports():
    return {"router": free_port(), "kvcached": free_port(), "worker": free_port()}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, metrics_ports):
    """kvcached, a worker and a router with their metrics endpoints on (a later --metrics-port wins)."""
    services = LocalServices(tmp_path_factory.mktemp("logs"))
    try:
        kvcached = services.kvcached(args=["--metrics-port", str(metrics_ports["kvcached"])])
        worker = services.worker(kvcached, args=["--metrics-port", str(metrics_ports["worker"])])
        yield services.router([worker], kvcached, args=["--metrics-port", str(metrics_ports["router"])])
    finally:
        services.stop()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, metrics_ports, stack):
    directory = tmp_path_factory.mktemp("prometheus")
    (directory / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(metrics_ports)))
    address = f"127.0.0.1:{free_port()}"
    with open(directory / "prometheus.log", "ab") as log:
        process = subprocess.Popen(["prometheus", f"--config.file={directory / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={directory / 'data'}", f"--web.listen-address={address}"],
                                   stdout=log, stderr=subprocess.STDOUT)
    server = Prometheus(f"http://{address}")
    try:
        assert wait_for(lambda: process.poll() is not None or server.ready(), 30) and process.poll() is None
        yield server
    finally:
        process.terminate()
        process.wait(30)


def test_every_job_is_scraped(prometheus):
    assert wait_for(lambda: prometheus.scalar("count(up == 1)") == 3, 30)


def test_l1_hit_ratio_over_promql_matches_the_responses(stack, prometheus):
    """A cold long prompt, then the same prompt again: the second reuses the first's pages from the worker's L1.
    The router's counters, scraped, give sum(cached l1) / sum(prompt tokens) over both, as the usage fields do."""
    messages = ask(document(7001), "Which lamp was lit?")
    usages = [generate(stack, messages).usage for _ in range(2)]
    assert usages[0].cached_tokens == 0 and usages[1].cached_tokens_l1 > 0
    # requests_total counts a request after its usage went into the other counters: a scrape that saw 2 saw all.
    assert wait_for(lambda: prometheus.scalar("sum(radixserve_requests_total)") == 2, 30)
    prompt = sum(u.prompt_tokens for u in usages)
    ratio = prometheus.scalar('sum(radixserve_cached_tokens_total{tier="l1"}) / sum(radixserve_prompt_tokens_total)')
    assert ratio == pytest.approx(sum(u.cached_tokens_l1 for u in usages) / prompt, rel=1e-12)


def test_every_dashboard_query_evaluates(prometheus):
    """Grafana's `$__rate_interval` is at least four scrape intervals; 1m stands in for it."""
    for expr in (t["expr"] for p in dashboard.build()["panels"] for t in p.get("targets", [])):
        prometheus.query(expr.replace(dashboard.RATE, "[1m]"))
