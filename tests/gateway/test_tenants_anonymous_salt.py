"""Tenants as vLLM's clients meet them: with --allow-anonymous any key that is not a tenant's
(the `openai` client's "EMPTY") is the anonymous tenant, without it a 401; and a request's
cache_salt narrows its tenant's namespace without ever showing the salt in clear."""
from __future__ import annotations

import json

import pytest

from gateway.core.tenants import AuthError, Tenant, TenantDirectory
from prefixcache_client.hash import MAX_NAME_BYTES


@pytest.fixture
def tenants_file(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tokens": {"t1": {"tenant": "a", "salt": "s"}}}))
    return path


@pytest.mark.parametrize("header", ["Bearer EMPTY", "Bearer nope", "Basic x", "Bearer "])
def test_any_other_key_is_anonymous_only_with_allow_anonymous(tenants_file, header):
    open_ = TenantDirectory.from_file(tenants_file, allow_anonymous=True)
    assert open_.authenticate([("authorization", header)]) == Tenant("anonymous", "")
    assert open_.authenticate([("authorization", "Bearer t1")]) == Tenant("a", "s")
    closed = TenantDirectory.from_file(tenants_file)
    with pytest.raises(AuthError):
        closed.authenticate([("authorization", header)])
    with pytest.raises(AuthError, match="sent 2 times"):  # still never guessed between two
        open_.authenticate([("authorization", "Bearer t1"), ("authorization", "Bearer x")])


def test_cache_salt_narrows_the_namespace_and_is_never_in_clear():
    a, b = Tenant("a", "s"), Tenant("b", "")
    assert a.with_cache_salt(None) is a and a.with_cache_salt("") is a
    x = a.with_cache_salt("user-42")
    assert x.name == "a" and x.salt != a.salt and "user-42" not in x.salt
    assert x == a.with_cache_salt("user-42")  # the same salt, the same namespace
    assert x != a.with_cache_salt("user-43")
    # Two tenants with the same cache_salt stay apart; the result fits the salt's bound.
    assert b.with_cache_salt("user-42").salt != x.salt
    assert len(a.with_cache_salt("z" * 256).salt.encode()) <= MAX_NAME_BYTES
    assert x.salt.isascii() and x.salt.isprintable()  # valid gRPC metadata
