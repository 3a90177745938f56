"""`python -m deploy.healthcheck HOST:PORT`: exits 0 when the gRPC server there reports SERVING on the standard
health service (`grpc.health.v1.Health/Check`, the server as a whole), 1 otherwise. docker-compose.yml's
healthchecks run it inside the image; plaintext only, as the compose stack runs without TLS."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 3.0


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m deploy.healthcheck HOST:PORT", file=sys.stderr)
        return 2
    return 0 if serving(argv[0]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
