"""`radixserve-worker` / `python -m model_worker`: load the model, then serve `radixserve.v1.Worker`."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from model_worker.config import WorkerConfig
from model_worker.engine import Engine
from model_worker.loader import resolve_model
from model_worker.metrics import watch_engine
from model_worker.service import WorkerServicer
from radixserve.config import parse_config
from radixserve.server import ServiceSpec, die_with_launcher, keep_freed_memory, serve, setup_logging
from radixserve.v1 import worker_pb2_grpc

log = logging.getLogger("model_worker")


async def run(config: WorkerConfig) -> None:
    model_dir = resolve_model(config.model)
    engine = Engine(model_dir, config)
    keep_freed_memory()  # from here on: what loading freed (the weights' packing buffers) goes back to the kernel
    log.info("model loaded", extra={"model": engine.info.name, "dtype": engine.info.dtype,
                                    "fingerprint": engine.info.fingerprint})
    # A dead engine loop stops the process (health NOT_SERVING while it drains, then exit 1) so a supervisor restarts
    # it, instead of a worker that accepts requests and never answers them.
    engine.start(on_death=lambda: os.kill(os.getpid(), signal.SIGTERM))
    watch_engine(engine)
    servicer = WorkerServicer(engine, str(model_dir), config.max_running_requests)
    try:
        await serve("worker", config.host, config.port, config.metrics_port,
                    [ServiceSpec(servicer, worker_pb2_grpc.add_WorkerServicer_to_server, "radixserve.v1.Worker")],
                    grace_s=config.drain_grace_s, security=config, traces_endpoint=config.otlp_traces_endpoint)
    finally:
        engine.stop()
    if engine.dead:
        sys.exit("the engine loop died; exiting so a supervisor restarts the worker")


def main(argv: list[str] | None = None) -> None:
    config = parse_config(WorkerConfig, argv)
    die_with_launcher()
    setup_logging(config.log_level)
    asyncio.run(run(config))


if __name__ == "__main__":
    main()
