"""Benchmarks: `python -m bench quick` (`make bench`) compares radixserve with baselines in the same run."""

import os
import platform
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from model_worker.config import DType
from model_worker.engine import resolve_dtype
from radixserve.launch import LocalServices


@dataclass(frozen=True)
class Row:
    """One benchmark result; `baseline` None where there is nothing to compare against in the same run."""

    name: str
    ours: float
    baseline: float | None
    unit: str
    goal: str

    @property
    def ratio(self) -> float | None:
        return self.ours / self.baseline if self.baseline else None


def machine() -> dict:
    """The machine a run measured, for its results file."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "memory_gb": round(memory_gb, 1),
            "python": platform.python_version(), "torch": torch.__version__}


def engine_device() -> torch.device:
    """Where a worker runs on this machine; in-process baselines run there too."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolved_dtype(name: str = "auto") -> str:
    """The dtype a worker started with `--dtype name` runs in on this machine, e.g. "float32"."""
    return str(resolve_dtype(DType(name), engine_device())).removeprefix("torch.")


@contextmanager
def local_services(name: str) -> Iterator[LocalServices]:
    """Services started in the block and stopped after it, their logs in a fresh directory: removed after a clean
    run, named in the error of a failed one."""
    log_dir = Path(tempfile.mkdtemp(prefix=f"radixserve-bench-{name}-"))
    services = LocalServices(log_dir)
    try:
        yield services
    except BaseException as e:
        e.add_note(f"process logs: {log_dir}")
        raise
    finally:
        services.stop()
    shutil.rmtree(log_dir)
