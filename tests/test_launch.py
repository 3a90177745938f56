"""The launcher (`python -m radixserve.launch`, `make run`) through real processes: however it is signalled or
killed, and whenever (up, or still loading the model), no service outlives it and its ports come free."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from radixserve.config import cache_root
from radixserve.launch import REPO, free_port, wait_for

pytestmark = pytest.mark.e2e

UP = "radixserve is up"
LOADING = "loading the model"
GONE_S = 15  # the launcher's budget: three services, 5 s of grace each


def processes() -> dict[int, tuple[int, int]]:
    """Every process that runs, zombies left out (an orphan's may linger unreaped): pid -> (ppid, pgrp)."""
    table = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        state, ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
        if state != "Z":
            table[int(entry)] = (int(ppid), int(pgrp))
    return table


def descendants(root: int) -> set[int]:
    table, found, frontier = processes(), set(), {root}
    while frontier:
        frontier = {pid for pid, (ppid, _) in table.items() if ppid in frontier} - found
        found |= frontier
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        return Path("/proc", str(pid), "cmdline").read_bytes().decode().split("\0")
    except OSError:  # exited meanwhile
        return []


def port_free(port: int) -> bool:
    """Nobody listens on `port` (SO_REUSEADDR: a closed connection's TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass
class Launcher:
    process: subprocess.Popen
    log: Path
    ports: tuple[int, ...]
    seen: set[int] = field(default_factory=set)  # every service process seen, for the checks and the clean-up

    def wait_for_output(self, text: str, timeout_s: float = 180) -> None:
        printed = wait_for(lambda: text in self.log.read_text() or self.process.poll() is not None, timeout_s)
        assert printed and text in self.log.read_text(), self.log.read_text()[-4000:]

    def services(self) -> set[int]:
        """Every descendant of the launcher seen so far, now included: the services and their helpers (kvcached's
        resource tracker)."""
        self.seen |= descendants(self.process.pid)
        return set(self.seen)

    def runs(self, module: str) -> bool:
        """Some service process runs `python -m module`."""
        return any(_cmdline(pid)[1:3] == ["-m", module] for pid in self.services())

    def all_gone(self) -> bool:
        """The launcher exited, and no service process, nor any process in their groups or the launcher's, runs."""
        pids = {self.process.pid, *self.seen}
        return self.process.poll() is not None and not any(p in pids or g in pids for p, (_, g) in processes().items())


@pytest.fixture
def launcher(tmp_path):
    """The launcher in a session of its own, on free ports with metrics off, its disk tier under `tmp_path` (a
    cache root that links the real converted models and the built CPU kernels in); kills whatever it left."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for built in ("models", "kernels"):  # converted once, compiled once: not again for every launch
        (cache / built).symlink_to(cache_root() / built)
    ports = (free_port(), free_port(), free_port())
    log = tmp_path / "launch.log"
    args = ["--router-port", str(ports[0]), "--kvcached-port", str(ports[1]), "--worker-port", str(ports[2]),
            "--no-metrics"]
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "radixserve.launch", *args], stdout=out,
                                   stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                   env={**os.environ, "RADIXSERVE_CACHE": str(cache)})
    launched = Launcher(process, log, ports)
    yield launched
    for pid in {process.pid, *launched.seen} & set(processes()):
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(pid, signal.SIGKILL)
    process.wait()


def test_two_sigterms_to_the_group_stop_every_service(launcher):
    launcher.wait_for_output(UP)
    assert len(launcher.services()) >= 3 and not any(port_free(p) for p in launcher.ports)
    os.killpg(launcher.process.pid, signal.SIGTERM)  # what a supervisor or `docker stop` does, twice
    os.killpg(launcher.process.pid, signal.SIGTERM)
    assert wait_for(launcher.all_gone, GONE_S), launcher.log.read_text()[-4000:]
    assert launcher.process.returncode == 0
    assert all(port_free(p) for p in launcher.ports)


def test_sigkill_of_the_launcher_alone_takes_every_service_with_it(launcher):
    launcher.wait_for_output(UP)
    assert len(launcher.services()) >= 3 and not any(port_free(p) for p in launcher.ports)
    os.kill(launcher.process.pid, signal.SIGKILL)
    assert wait_for(launcher.all_gone, GONE_S), launcher.log.read_text()[-4000:]
    assert all(port_free(p) for p in launcher.ports)


def test_signals_while_the_model_loads_stop_what_started(launcher):
    launcher.wait_for_output(LOADING, timeout_s=60)
    assert wait_for(lambda: launcher.runs("model_worker"), 10)  # kvcached serves; the worker imports and loads
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
        os.killpg(launcher.process.pid, sig)
    assert wait_for(launcher.all_gone, GONE_S), launcher.log.read_text()[-4000:]
    assert launcher.process.returncode == 0
    assert UP not in launcher.log.read_text()
    assert all(port_free(p) for p in launcher.ports)
