"""The router's view of kvcached: match a prompt's cached prefix and lease it for the worker.

kvcached is an accelerator, never a dependency: any failure or a missed deadline yields "no match", a log line and
`radixserve_kvcached_errors_total`; the request is then recomputed. gRPC channels reconnect on their own, so reuse
resumes when kvcached comes back.
"""

from __future__ import annotations

import logging

import grpc

from radixserve.v1 import kvcached_pb2, kvcached_pb2_grpc, worker_pb2
from router import metrics

log = logging.getLogger("router.prefix")


class PrefixMatcher:
    def __init__(self, address: str, fingerprint: str, timeout_s: float, lease_ttl_ms: int):
        self._stub = kvcached_pb2_grpc.KVCacheStub(grpc.aio.insecure_channel(address))
        self._address = address
        self._fingerprint = fingerprint
        self._timeout_s = timeout_s
        self._lease_ttl_ms = lease_ttl_ms

    async def lease(self, token_ids: list[int], cache_salt: str) -> worker_pb2.L2Lease | None:
        """The leased L2 slots of the longest cached prefix of `token_ids`, or None (no match, or kvcached down)."""
        request = kvcached_pb2.MatchPrefixRequest(model_fingerprint=self._fingerprint, cache_salt=cache_salt,
                                                  token_ids=token_ids, lease=True, lease_ttl_ms=self._lease_ttl_ms)
        try:
            match = await self._stub.MatchPrefix(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as e:
            metrics.kvcached_errors.labels(op="match").inc()
            log.warning("kvcached match failed; recomputing", extra={"kvcached": self._address,
                                                                     "code": e.code().name, "details": e.details()})
            return None
        if not match.lease_id:
            return None
        return worker_pb2.L2Lease(lease_id=match.lease_id, segment_name=match.segment_name, slots=match.l2_slots)
