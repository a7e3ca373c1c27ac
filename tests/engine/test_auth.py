import os
import stat

import pytest

from engine.auth import CredentialChecker, create_secret, load_secret, make_credential, secret_path
from engine.errors import ShoalError, Unauthenticated
from engine.tls import door_request, make_identity, shows_pass

METHOD = "/shoal.v1.ExpertService/Compute"


def test_secret_file_is_private_and_not_overwritten(tmp_path):
    path = create_secret(tmp_path / "conf" / "secret")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    first = load_secret(path)
    with pytest.raises(ShoalError, match="already exists"):
        create_secret(path)
    create_secret(path, force=True)
    assert load_secret(path) != first


def test_secret_path_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_SECRET_FILE", str(tmp_path / "env"))
    assert str(secret_path("explicit")) == "explicit"
    assert secret_path(None) == tmp_path / "env"
    monkeypatch.delenv("SHOAL_SECRET_FILE")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert secret_path(None) == tmp_path / "xdg" / "shoal" / "secret"


def test_missing_secret_says_how_to_make_one(tmp_path):
    with pytest.raises(ShoalError, match="shoal cluster-init"):
        load_secret(tmp_path / "nope")


def test_credentials_verify_and_refuse_wrong_secret_method_age_and_replay():
    secret, other = b"a" * 64, b"b" * 64
    checker = CredentialChecker(secret)
    good = make_credential(secret, METHOD, now=1000.0)
    checker.check(good, METHOD, now=1001.0)
    with pytest.raises(Unauthenticated, match="already used"):
        checker.check(good, METHOD, now=1002.0)
    with pytest.raises(Unauthenticated, match="cluster secret"):
        checker.check(make_credential(other, METHOD, now=1000.0), METHOD, now=1000.0)
    with pytest.raises(Unauthenticated, match="cluster secret"):
        checker.check(make_credential(secret, "/other", now=1000.0), METHOD, now=1000.0)
    with pytest.raises(Unauthenticated, match="clocks"):
        checker.check(make_credential(secret, METHOD, now=0.0), METHOD, now=1000.0)
    with pytest.raises(Unauthenticated, match="missing"):
        checker.check(None, METHOD)
    with pytest.raises(Unauthenticated, match="malformed"):
        checker.check("garbage", METHOD)


def test_every_credential_but_the_inventorys_is_bound_to_the_worker_it_was_made_for():
    secret = b"a" * 64
    inventory = "/shoal.v1.ExpertService/GetInventory"
    a, b = CredentialChecker(secret, node="mac-a"), CredentialChecker(secret, node="mac-b")
    for name in ("DropExpert", "ReadExpert", "GetStats", "GetHeat", "ExpertFileStatus"):
        method = f"/shoal.v1.ExpertService/{name}"
        for_a = make_credential(secret, method, node="mac-a", now=1000.0)
        with pytest.raises(Unauthenticated, match="another worker"):
            b.check(for_a, method, now=1000.0)  # presented to another worker: refused
        a.check(for_a, method, now=1000.0)
        with pytest.raises(Unauthenticated, match="must be made for this worker"):
            a.check(make_credential(secret, method, now=1000.0), method, now=1000.0)
    # the inventory comes before the coordinator knows whom it talks to
    b.check(make_credential(secret, inventory, now=1000.0), inventory, now=1000.0)
    b.check(make_credential(secret, inventory, node="mac-b", now=1000.0), inventory, now=1000.0)


def test_secret_is_0600_whatever_was_there_and_a_readable_one_is_refused(tmp_path):
    """A leftover `secret.tmp` of mode 0644 (and a 0644 secret being replaced, and a umask
    of 0) used to make the new secret world-readable; and such a secret loaded silently."""
    path = tmp_path / "conf" / "secret"
    path.parent.mkdir()
    leftover = path.with_name("secret.tmp")
    leftover.write_text("old secret " * 8)
    leftover.chmod(0o644)
    path.write_text("w" * 64)
    path.chmod(0o644)
    old_umask = os.umask(0)
    try:
        create_secret(path, force=True)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not leftover.exists()
    assert [p.name for p in path.parent.iterdir()] == ["secret"]  # no temporary file left
    assert len(load_secret(path)) == 64
    for mode in (0o644, 0o640, 0o604, 0o660):
        path.chmod(mode)
        with pytest.raises(ShoalError, match=f"mode {mode:04o}.*chmod 600"):
            load_secret(path)


def test_the_front_doors_pass_is_shown_only_by_who_holds_the_clusters_key(secret_file):
    ours, theirs = load_secret(secret_file).identity, make_identity()
    request = door_request("10.0.0.2:50551", ours)
    assert request.startswith(b"CONNECT 10.0.0.2:50551 HTTP/1.1\r\n")
    assert shows_pass(request, ours) and not shows_pass(request, theirs)
    assert not shows_pass(door_request("10.0.0.2:50551", theirs), ours)
    for forged in (b"CONNECT a:1 HTTP/1.1\r\n\r\n",  # none
                   b"CONNECT a:1 HTTP/1.1\r\nProxy-Authorization: Basic !!\r\n\r\n",
                   b"CONNECT a:1 HTTP/1.1\r\nProxy-Authorization: Basic w4k=\r\n\r\n"):
        assert not shows_pass(forged, ours)
