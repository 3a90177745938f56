"""Who a public request comes from, and which cache namespace that gives it.

With `--api-keys-file` every public call (gRPC and HTTP) must carry `authorization: Bearer <key>` naming a key of
the file, else UNAUTHENTICATED (HTTP 401). `--tenant-from` says where a request's cache namespace comes from:
- `salt` (the default): the client's `cache_salt`, as in vLLM and SGLang. Any client that knows or guesses another's
  salt shares its cache, and `usage.cached_tokens` tells it how much of a prompt someone else sent before.
- `api_key`: the tenant its key belongs to; `client_cert`: the identity of its mutual-TLS client certificate. The
  client's `cache_salt` then only partitions further within its own tenant, so no tenant can reach or probe
  another's cached prefixes whatever it sends.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from radixserve.config import Choice
from radixserve.server import ServiceError


class TenantSource(Choice):
    SALT = "salt"
    API_KEY = "api_key"
    CLIENT_CERT = "client_cert"


def _digest(key: str) -> bytes:
    # Keys are looked up by digest: the lookup's timing reveals nothing about the keys.
    return hashlib.sha256(key.encode()).digest()


def read_api_keys(path: str) -> dict[bytes, str]:
    """`path`'s `<tenant> <key>` lines (blank lines and `#` comments skipped) as key digest -> tenant; raises
    ValueError on a malformed line or a key given twice."""
    keys: dict[bytes, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(f"{path}:{number}: expected '<tenant> <key>'")
        tenant, key = fields
        if _digest(key) in keys:
            raise ValueError(f"{path}:{number}: a key given twice")
        keys[_digest(key)] = tenant
    if not keys:
        raise ValueError(f"{path} holds no API key")
    return keys


@dataclass(frozen=True)
class Tenants:
    """The router's authentication and namespacing policy (module docstring); `keys` is `read_api_keys`'s map,
    empty when no API key is required."""

    source: TenantSource = TenantSource.SALT
    keys: Mapping[bytes, str] = field(default_factory=dict)

    def identify(self, authorization: str | None, peer: str | None) -> str | None:
        """The caller's tenant from its `authorization` header and verified mTLS `peer` identity: None when
        namespaces come from salts; raises UNAUTHENTICATED when a required key or certificate is missing or wrong."""
        tenant = None
        if self.keys:
            scheme, _, key = (authorization or "").partition(" ")
            tenant = self.keys.get(_digest(key)) if scheme.lower() == "bearer" and key else None
            if tenant is None:
                raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required "
                                                                    "(authorization: Bearer <key>)")
        if self.source is TenantSource.CLIENT_CERT:
            if not peer:
                raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, "a client certificate is required")
            return peer
        return tenant if self.source is TenantSource.API_KEY else None

    @staticmethod
    def cache_salt(tenant: str | None, client_salt: str) -> str:
        """The salt a request's cache namespace is keyed by: the client's own without a tenant, else the tenant and
        the client's salt length-prefixed, so that no (tenant, salt) pair can spell another's."""
        if tenant is None:
            return client_salt
        return f"tenant:{len(tenant)}:{tenant}:{client_salt}"


OPEN = Tenants()  # no API keys, namespaces from clients' salts: the default
