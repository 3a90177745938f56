"""TLS, mutual TLS, the internal token and tenants, through real processes (`radixserve.transport`,
`router.tenants`).

One stack where every server is mutual TLS and the internal services require the token: Generate works through all
three services with the operator's certificate (and a hit answers as the cold run did), while a plaintext client, a
client without a certificate and one with a certificate from another CA are refused, and the internal services
refuse a certificate holder without the token. Two more routers on the same worker key cache namespaces by tenant:
one by client certificate, one by API key (gRPC and HTTP): a tenant's prompt is a hit for itself only, whatever salt
another sends, and every answer equals the cold one. A kvcached alone shows the token over plaintext loopback (gRPC's
local credentials) and the metrics endpoint over mutual TLS.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from model_worker.config import WorkerConfig
from radixserve.launch import LocalServices, Stack, free_port, wait_for
from radixserve.transport import TransportSecurity, open_channel
from radixserve.v1 import kvcache_pb2, kvcache_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from router.config import RouterConfig
from tests.stack import GREEDY, ask, document

pytestmark = pytest.mark.e2e

TOKEN = "s3cret-token-of-the-internal-rpcs"
FRANCE = [router_pb2.ChatMessage(role="user", content="What is the capital of France?")]


def write_identity(ca: trustme.CA, directory: Path, name: str, identity: str = "127.0.0.1") -> tuple[str, str]:
    """A certificate for `identity` (server and client use) and its key, issued by `ca`: the two paths."""
    leaf = ca.issue_cert(identity)
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    cert.write_bytes(b"".join(pem.bytes() for pem in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(key))
    return str(cert), str(key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, TransportSecurity]:
    """The operator's CA with a service identity, and the wrong identities: `mtls` is what every service runs
    with (and an authorised client holds); the others are what strangers hold."""
    directory = tmp_path_factory.mktemp("pki")
    ca, other_ca = trustme.CA(), trustme.CA()
    ca_path = directory / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    token = directory / "token"
    token.write_text(TOKEN + "\n")
    cert, key = write_identity(ca, directory, "service")
    stranger_cert, stranger_key = write_identity(other_ca, directory, "stranger")
    mtls = TransportSecurity(cert, key, str(ca_path), True, str(token))
    tenants = {name: write_identity(ca, directory, name, f"{name}.clients.example") for name in ("alice", "bob")}
    (directory / "api-keys").write_text("alice key-of-alice\nbob key-of-bob\n")
    return {"mtls": mtls,
            **{name: TransportSecurity(cert, key, str(ca_path)) for name, (cert, key) in tenants.items()},
            "mtls_without_token": replace(mtls, auth_token_file=""),
            "server_auth_only": TransportSecurity(tls_ca=str(ca_path), tls_cert="", tls_key=""),
            "other_ca": TransportSecurity(stranger_cert, stranger_key, str(ca_path)),
            "token_only": TransportSecurity(auth_token_file=str(token))}


@pytest.fixture(scope="module")
def secure(pki, tmp_path_factory):
    services = LocalServices(tmp_path_factory.mktemp("tls-logs"), Stack(security=pki["mtls"]))
    try:
        kvcached = services.kvcached()
        worker = services.worker(kvcached)
        yield services, kvcached, worker, services.router([worker], kvcached)
    finally:
        services.stop()


def generate(address: str, security: TransportSecurity, messages, timeout: float = 120) -> router_pb2.GenerateResponse:
    with open_channel(address, security) as channel:
        (response,) = router_pb2_grpc.RouterStub(channel).Generate(
            router_pb2.GenerateRequest(messages=messages, sampling=GREEDY), timeout=timeout)
    return response


def refusal(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_generate_works_through_all_three_services_over_mutual_tls(secure, pki):
    services, kvcached, worker, router = secure
    assert "Paris" in generate(router, pki["mtls"], FRANCE).text
    prompt = ask(document(7), "What is this about?")
    cold = generate(router, pki["mtls"], prompt)
    # The worker registered with kvcached and committed there: both internal hops ran over mTLS with the token. The
    # commit is queued on the worker's kvcached thread after the answer, so it may land a moment later (seen in a run
    # beside another busy process: no block yet right after the answer).
    assert services.workers_registered([worker])
    with open_channel(kvcached, pki["mtls"]) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        assert wait_for(lambda: sum(ns.blocks_cached for ns in stub.GetStats(
            kvcache_pb2.GetStatsRequest(), timeout=5).namespaces) > 0, 10)
    hit = generate(router, pki["mtls"], prompt)
    assert hit.usage.cached_tokens > 0
    assert list(hit.token_ids) == list(cold.token_ids)


@pytest.mark.parametrize("holder", ["plaintext", "server_auth_only", "other_ca"])
def test_a_client_without_the_right_certificate_is_refused(secure, pki, holder):
    _, _, _, router = secure
    if holder == "plaintext":
        channel = grpc.insecure_channel(router)
    else:  # TLS that verifies the router, but presents no client certificate, or one the router's CA never issued
        channel = open_channel(router, pki[holder])
    with channel:
        stub = router_pb2_grpc.RouterStub(channel)
        assert refusal(lambda: stub.ListModels(router_pb2.ListModelsRequest(), timeout=10)) == \
            grpc.StatusCode.UNAVAILABLE


def test_the_internal_services_refuse_a_certificate_holder_without_the_token(secure, pki):
    _, kvcached, worker, _ = secure
    with open_channel(worker, pki["mtls_without_token"]) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        assert refusal(lambda: stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)) == \
            grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # a supervisor's probe needs no token
    with open_channel(kvcached, pki["mtls_without_token"]) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        assert refusal(lambda: stub.GetStats(kvcache_pb2.GetStatsRequest(), timeout=10)) == \
            grpc.StatusCode.UNAUTHENTICATED
    with open_channel(kvcached, pki["mtls"]) as channel:  # and the holder of both gets through
        kvcache_pb2_grpc.KVCacheStub(channel).GetStats(kvcache_pb2.GetStatsRequest(), timeout=10)


def test_a_token_over_plaintext_loopback_and_metrics_over_mutual_tls(pki, tmp_path):
    services = LocalServices(tmp_path, Stack(security=pki["token_only"]))
    metrics_port = free_port()
    try:
        plain = services.kvcached("kvcached_token")
        with grpc.insecure_channel(plain) as channel:  # local credentials speak plaintext HTTP/2 on loopback
            stub = kvcache_pb2_grpc.KVCacheStub(channel)
            assert refusal(lambda: stub.GetStats(kvcache_pb2.GetStatsRequest(), timeout=10)) == \
                grpc.StatusCode.UNAUTHENTICATED
        with open_channel(plain, pki["token_only"]) as channel:
            kvcache_pb2_grpc.KVCacheStub(channel).GetStats(kvcache_pb2.GetStatsRequest(), timeout=10)

        services.stack.security = pki["mtls"]
        services.kvcached("kvcached_mtls", ["--metrics-port", str(metrics_port)])
        mtls = pki["mtls"]
        context = ssl.create_default_context(cafile=mtls.tls_ca)
        url = f"https://127.0.0.1:{metrics_port}/metrics"
        with pytest.raises(OSError):  # no client certificate: the handshake fails
            urllib.request.urlopen(url, context=context, timeout=10)
        context.load_cert_chain(mtls.tls_cert, mtls.tls_key)
        with urllib.request.urlopen(url, context=context, timeout=10) as response:
            assert b"radixserve_kvcached" in response.read()
    finally:
        services.stop()


def test_config_refuses_what_would_leak_or_cannot_work(pki):
    token = pki["token_only"].auth_token_file
    with pytest.raises(ValueError, match="in clear"):
        WorkerConfig(host="0.0.0.0", auth_token_file=token)
    RouterConfig(host="0.0.0.0", auth_token_file=token)  # the router's own server is public: no token there
    with pytest.raises(ValueError, match="go together"):
        TransportSecurity(tls_cert=pki["mtls"].tls_cert)
    with pytest.raises(ValueError, match="needs"):
        TransportSecurity(tls_client_auth=True)
    with pytest.raises(ValueError, match="no such file"):
        TransportSecurity(tls_ca="/nonexistent/ca.pem")


@pytest.fixture(scope="module")
def tenant_routers(secure, pki):
    """Routers on the secure stack's worker: by client certificate, and by API key with its HTTP API."""
    services, kvcached, worker, _ = secure
    keys = str(Path(pki["mtls"].tls_ca).parent / "api-keys")
    http_port = free_port()
    return {"client_cert": services.router([worker], kvcached, "router_by_cert", ["--tenant-from", "client_cert"]),
            "api_key": services.router([worker], kvcached, "router_by_key",
                                       ["--tenant-from", "api_key", "--api-keys-file", keys], http_port=http_port),
            "http": f"https://127.0.0.1:{http_port}"}


def generate_as(address: str, security: TransportSecurity, messages, salt: str = "shared", key: str | None = None
                ) -> router_pb2.GenerateResponse:
    with open_channel(address, security) as channel:
        (response,) = router_pb2_grpc.RouterStub(channel).Generate(
            router_pb2.GenerateRequest(messages=messages, sampling=GREEDY, cache_salt=salt), timeout=120,
            metadata=[("authorization", f"Bearer {key}")] if key else None)
    return response


def test_client_certificates_keep_tenants_out_of_each_others_cache(tenant_routers, pki):
    router = tenant_routers["client_cert"]
    prompt = ask(document(11), "Which season is named?")
    cold = generate_as(router, pki["alice"], prompt)
    assert cold.usage.cached_tokens == 0
    stranger = generate_as(router, pki["bob"], prompt)  # the same prompt and salt, another certificate
    again = generate_as(router, pki["alice"], prompt)
    assert stranger.usage.cached_tokens == 0 and again.usage.cached_tokens > 0
    assert list(stranger.token_ids) == list(again.token_ids) == list(cold.token_ids)


def test_api_keys_authenticate_and_keep_tenants_apart_over_grpc_and_http(tenant_routers, pki):
    router, mtls = tenant_routers["api_key"], pki["mtls_without_token"]  # a client holds no internal token
    for key in (None, "key-of-carol"):
        with pytest.raises(grpc.RpcError) as err:
            generate_as(router, mtls, FRANCE, key=key)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    prompt = ask(document(12), "What was lit?")
    cold = generate_as(router, mtls, prompt, key="key-of-alice")
    stranger = generate_as(router, mtls, prompt, key="key-of-bob")
    assert cold.usage.cached_tokens == 0 and stranger.usage.cached_tokens == 0
    assert list(stranger.token_ids) == list(cold.token_ids)

    context = ssl.create_default_context(cafile=mtls.tls_ca)
    context.load_cert_chain(mtls.tls_cert, mtls.tls_key)
    body = json.dumps({"messages": [{"role": m.role, "content": m.content} for m in prompt], "temperature": 0,
                       "max_tokens": GREEDY.max_new_tokens, "cache_salt": "shared"}).encode()

    def chat(key: str | None) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        request = urllib.request.Request(tenant_routers["http"] + "/v1/chat/completions", body, headers)
        try:
            with urllib.request.urlopen(request, context=context, timeout=120) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    status, answer = chat(None)
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    status, answer = chat("key-of-alice")  # alice's prompt again, over HTTP: her cache, the same answer
    assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert answer["choices"][0]["message"]["content"] == cold.text
