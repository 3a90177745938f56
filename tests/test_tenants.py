"""The router's tenant policy (`router.tenants`): API keys, identities and the salts they key namespaces by."""

from __future__ import annotations

import grpc
import pytest

from radixserve.blocks.keys import namespace_key
from radixserve.server import ServiceError
from router.tenants import Tenants, TenantSource, read_api_keys


@pytest.fixture
def keys(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# tenant key\nalice key-of-alice\n\nbob   key-of-bob\n")
    return read_api_keys(str(path))


def unauthenticated(tenants: Tenants, authorization: str | None, peer: str | None = None) -> str:
    with pytest.raises(ServiceError) as err:
        tenants.identify(authorization, peer)
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    return err.value.message


def test_api_keys_name_their_tenant_and_anything_else_is_unauthenticated(keys):
    tenants = Tenants(TenantSource.API_KEY, keys)
    assert tenants.identify("Bearer key-of-alice", None) == "alice"
    assert tenants.identify("bearer key-of-bob", None) == "bob"
    for wrong in (None, "", "Bearer", "Bearer ", "key-of-alice", "Basic key-of-alice", "Bearer key-of-carol",
                  "Bearer key-of-alice2"):
        assert "API key" in unauthenticated(tenants, wrong)


def test_with_salt_namespaces_a_key_only_gates_access(keys):
    tenants = Tenants(TenantSource.SALT, keys)
    assert tenants.identify("Bearer key-of-alice", None) is None
    unauthenticated(tenants, None)
    assert Tenants().identify(None, None) is None  # the default: open, salts chosen by clients


def test_client_certificates_name_their_tenant():
    tenants = Tenants(TenantSource.CLIENT_CERT)
    assert tenants.identify(None, "tenant-a.clients.example") == "tenant-a.clients.example"
    assert "certificate" in unauthenticated(tenants, "Bearer anything", None)


def test_tenant_salts_never_collide_with_another_tenants_or_a_bare_salt():
    salts = {Tenants.cache_salt(tenant, salt) for tenant, salt in
             [("a", ""), ("a", "b"), ("a:1:b", ""), ("a", "1:b:"), (None, ""), (None, "tenant:1:a:"), ("", "a")]}
    assert len(salts) == 7 - 1  # (None, "tenant:1:a:") spells ("a", ""), but only where no tenant exists
    assert Tenants.cache_salt(None, "mine") == "mine"
    fingerprint = "model"
    assert namespace_key(fingerprint, Tenants.cache_salt("alice", "x")) != \
        namespace_key(fingerprint, Tenants.cache_salt("bob", "x"))


@pytest.mark.parametrize("text, message", [("alice\n", "expected"), ("a k\nb k\n", "twice"), ("# none\n", "no API")])
def test_malformed_key_files_are_refused(tmp_path, text, message):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_api_keys(str(path))
