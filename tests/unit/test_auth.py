"""torchpass.auth against a private munged (the real libmunge, a throwaway key)."""

import os
import time

import pytest

from torchpass import auth
from torchpass.errors import AuthError, DependencyError
from tpassd.testing import MungeDaemon, credential_as


def test_roundtrip_gives_uid_gid(munge):
    cred = auth.make_credential(b"payload", munge.socket)
    assert auth.verify(cred, b"payload", munge.socket) == auth.Identity(os.getuid(), os.getgid())


def test_replayed_credential_is_rejected(munge):
    cred = auth.make_credential(b"p", munge.socket)
    auth.verify(cred, b"p", munge.socket)
    with pytest.raises(AuthError, match="replayed") as ei:
        auth.verify(cred, b"p", munge.socket)
    assert ei.value.code == "unauthenticated"


def test_credential_bound_to_its_request(munge):
    d1 = auth.request_digest("tpassd.drill", {"kind": "clear"}, "node2")
    for other in (auth.request_digest("tpassd.drill", {"kind": "xid79"}, "node2"),
                  auth.request_digest("tpassd.drill", {"kind": "clear"}, "node3"),
                  auth.request_digest("tpassd.status", {"kind": "clear"}, "node2")):
        assert other != d1
        with pytest.raises(AuthError, match="different request"):
            auth.verify(auth.make_credential(d1, munge.socket), other, munge.socket)


@pytest.mark.parametrize("cred", [None, "", "MUNGE:AAAA:", "not a credential", "é" * 10, "x" * 10000])
def test_forged_or_missing(munge, cred):
    with pytest.raises(AuthError) as ei:
        auth.verify(cred, b"p", munge.socket)
    assert ei.value.code == "unauthenticated"


def test_credential_from_another_key_is_forged(tmp_path, munge):
    with MungeDaemon(tmp_path / "other") as other:
        cred = auth.make_credential(b"p", other.socket)
    with pytest.raises(AuthError, match="invalid munge credential"):
        auth.verify(cred, b"p", munge.socket)


def test_expired_credential(munge):
    cred = auth.make_credential(b"p", munge.socket, ttl=1)
    time.sleep(2.2)
    with pytest.raises(AuthError, match="expired"):
        auth.verify(cred, b"p", munge.socket)


def test_other_users_identity(munge):
    cred = credential_as(65534, 65534, b"hello", munge.socket)
    assert auth.verify(cred, b"hello", munge.socket) == auth.Identity(65534, 65534)


def test_no_munged_is_a_dependency_error(tmp_path):
    with pytest.raises(DependencyError, match="munged running"):
        auth.make_credential(b"p", str(tmp_path / "absent.socket"))
