"""How every radixserve process listens and connects: plaintext, TLS or mutual TLS, and the internal token.

One rule for each process, from its `TransportSecurity` settings (every process config extends it):
- With `--tls-cert` and `--tls-key` its gRPC server (and its metrics endpoint) speaks TLS, and its clients speak
  TLS to the services it calls, presenting the same certificate as their client certificate and verifying the
  server's against `--tls-ca` (the system's roots when empty). The certificate must name the address it is reached
  at (an IP SAN 127.0.0.1 for loopback) and allow both server and client authentication.
- `--tls-client-auth` makes its server require a client certificate signed by `--tls-ca` (mutual TLS): set it on
  the internal services, kvcached and the worker, so that only holders of a certificate the operator issued reach
  them; on the router it makes the public API mutual TLS too (and a client certificate an identity, see
  `peer_identity`).
- `--auth-token-file` names a file holding a shared secret. The internal servers (kvcached, the worker) then refuse
  every RPC without `authorization: Bearer <secret>` as UNAUTHENTICATED, health checks and reflection excepted (a
  supervisor probes them); the router and the worker send it. Without TLS a bearer token would cross the network in
  clear, so it then rides gRPC's local credentials, which accept loopback peers only: config validation refuses a
  token on a plaintext server bound beyond loopback.
Plaintext without a token, on loopback, stays the default (`make run` on one machine).
"""

from __future__ import annotations

import hmac
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import grpc

from radixserve.config import setting

# Callable without the token: a supervisor's health probe, and grpcurl's schema lookup (no data in either).
TOKEN_EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_LOCAL_TCP = grpc.LocalConnectionType.LOCAL_TCP
# gRPC's reconnect backoff grows to 120 s while a peer is down: after kvcached had been down for 50 s, a channel with
# the defaults reached the restarted daemon 23 s after it served again, one with this cap in 1.0 s.
RECONNECT_OPTIONS = (("grpc.max_reconnect_backoff_ms", 1000),)


@dataclass(frozen=True)
class TransportSecurity:
    """TLS, mutual TLS and the internal token (see the module docstring); every process config extends it.

    `INTERNAL`: whether this process's own server is internal (kvcached, the worker), so requires the token.
    """

    INTERNAL: ClassVar[bool] = True

    tls_cert: str = setting("", "PEM certificate chain: this process serves TLS with it and presents it as its "
                                "client certificate; empty = plaintext")
    tls_key: str = setting("", "PEM private key of --tls-cert")
    tls_ca: str = setting("", "PEM CA certificates that verify the services this process calls and, with "
                              "--tls-client-auth, its own clients; empty = the system's roots")
    tls_client_auth: bool = setting(False, "require a client certificate signed by --tls-ca (mutual TLS) on this "
                                           "process's server")
    auth_token_file: str = setting("", "file holding the internal RPCs' shared secret: kvcached and the worker "
                                       "refuse calls without it (UNAUTHENTICATED), the router and worker send it")

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_auth and not (self.tls_cert and self.tls_ca):
            raise ValueError("--tls-client-auth needs --tls-cert, --tls-key and --tls-ca")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--tls-ca", self.tls_ca),
                           ("--auth-token-file", self.auth_token_file)):
            if path and not Path(path).is_file():
                raise ValueError(f"{flag}: no such file: {path}")
        if self.auth_token_file and not self.auth_token():
            raise ValueError(f"--auth-token-file {self.auth_token_file} is empty")
        host = getattr(self, "host", "127.0.0.1")
        if self.INTERNAL and self.auth_token_file and not self.tls_cert and not is_loopback(host):
            raise ValueError(f"a token without TLS would cross the network in clear: bind --host to loopback, not "
                             f"{host}, or add --tls-cert and --tls-key")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def auth_token(self) -> str:
        """The shared secret, '' without one (read from the file each time: a rotated file takes effect on the
        next connection)."""
        return Path(self.auth_token_file).read_text().strip() if self.auth_token_file else ""

    def flags(self) -> list[str]:
        """These settings as command-line flags, for a launcher that starts a process with the same security."""
        flags = [flag for name, value in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key),
                                          ("--tls-ca", self.tls_ca), ("--auth-token-file", self.auth_token_file))
                 if value for flag in (name, value)]
        return flags + (["--tls-client-auth"] if self.tls_client_auth else [])


PLAINTEXT = TransportSecurity()  # no TLS, no token: the default


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(security: TransportSecurity) -> grpc.ServerCredentials | None:
    """TLS (mutual with `tls_client_auth`), local credentials for an internal server's token without TLS, None for
    plaintext."""
    if security.tls:
        return grpc.ssl_server_credentials([(_read(security.tls_key), _read(security.tls_cert))],
                                           root_certificates=_read(security.tls_ca),
                                           require_client_auth=security.tls_client_auth)
    if security.INTERNAL and security.auth_token_file:
        return grpc.local_server_credentials(_LOCAL_TCP)
    return None


def server_ssl_context(security: TransportSecurity) -> ssl.SSLContext | None:
    """The same TLS for a non-gRPC server (the router's HTTP API): None for plaintext."""
    if not security.tls:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=security.tls_ca or None)
    context.load_cert_chain(security.tls_cert, security.tls_key)
    if security.tls_client_auth:
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def channel_credentials(security: TransportSecurity) -> grpc.ChannelCredentials | None:
    """What a client of the internal services connects with: TLS presenting this process's certificate, and the
    token on every call; None for plaintext."""
    if security.tls:
        base = grpc.ssl_channel_credentials(root_certificates=_read(security.tls_ca),
                                            private_key=_read(security.tls_key),
                                            certificate_chain=_read(security.tls_cert))
    elif security.auth_token_file:
        base = grpc.local_channel_credentials(_LOCAL_TCP)
    else:
        return None
    token = security.auth_token()
    return grpc.composite_channel_credentials(base, grpc.access_token_call_credentials(token)) if token else base


def open_channel(address: str, security: TransportSecurity, options: list[tuple[str, object]] = ()) -> grpc.Channel:
    """A blocking channel to `address` with `security`; it retries a lost peer at least every second
    (`RECONNECT_OPTIONS`, before `options`)."""
    credentials = channel_credentials(security)
    options = [*RECONNECT_OPTIONS, *options]
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def open_aio_channel(address: str, security: TransportSecurity,
                     options: list[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to `address` with `security`, retrying a lost peer as `open_channel`'s does."""
    credentials = channel_credentials(security)
    options = [*RECONNECT_OPTIONS, *options]
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, as UNAUTHENTICATED, every call without `authorization: Bearer <token>` but the exempt ones."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("an empty token admits nobody")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(TOKEN_EXEMPT_PREFIXES):
            return handler
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(presented).encode(), self._expected):
            return handler
        return handler._replace(**{kind: _unauthenticated for kind in
                                   ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
                                   if getattr(handler, kind) is not None})


async def _unauthenticated(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong authorization token")


def peer_identity(context: grpc.aio.ServicerContext) -> str | None:
    """The verified client certificate's identity (its first SAN, else its CN) on a mutual-TLS connection; None
    without one."""
    identities = context.peer_identities()
    return identities[0].decode(errors="replace") if identities else None
