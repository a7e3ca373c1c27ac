"""The lobby of silent connections (worker/lobby.py), as plain data: who is closed when room is
short, and what counts as the start of a TLS handshake."""

import socket

from worker.lobby import Lobby, begins_tls, ends_request, first_bytes, whole_record


def test_beyond_a_hosts_share_its_oldest_silent_one_is_closed_and_no_other_hosts():
    lobby: Lobby[str] = Lobby(per_host=2, total=10)
    lobby.add("other", "10.0.0.9", 0.0)
    for i in range(3):
        lobby.add(f"flood-{i}", "127.0.0.1", float(i + 1))
    assert lobby.overflow("127.0.0.1", lambda item: False) == ["flood-0"]
    assert "other" in lobby and len(lobby) == 3


def test_one_that_spoke_meanwhile_is_passed_over_and_the_next_oldest_closed():
    lobby: Lobby[str] = Lobby(per_host=2, total=10)
    for name in ("coordinator", "flood-1", "flood-2"):
        lobby.add(name, "127.0.0.1", 0.0)
    spoke = []
    closing = lobby.overflow("127.0.0.1", lambda item: item == "coordinator" and
                             not spoke.append(item))
    assert spoke == ["coordinator"]  # taken out of the lobby: the caller took it on
    assert closing == [] and len(lobby) == 2 and "coordinator" not in lobby
    lobby.add("flood-3", "127.0.0.1", 1.0)
    assert lobby.overflow("127.0.0.1", lambda item: False) == ["flood-1"]


def test_beyond_the_total_the_host_holding_most_gives_way():
    lobby: Lobby[str] = Lobby(per_host=10, total=4)
    for i in range(3):
        lobby.add(f"a-{i}", "10.0.0.1", float(i))
    lobby.add("b-0", "10.0.0.2", 3.0)
    lobby.add("b-1", "10.0.0.2", 4.0)
    assert lobby.overflow("10.0.0.2", lambda item: False) == ["a-0"]
    # room for two newcomers: one from each, as they hold as many (a first, on a tie)
    assert lobby.overflow("10.0.0.2", lambda item: False, room=2) == ["a-1", "b-0"]


def test_those_waiting_past_a_time_are_taken_out_oldest_first():
    lobby: Lobby[str] = Lobby(per_host=10, total=10)
    for i, host in enumerate(("h1", "h2", "h1", "h2")):
        lobby.add(f"{host}-{i}", host, float(i))
    assert sorted(lobby.older_than(2.0)) == ["h1-0", "h2-1"]
    assert len(lobby) == 2


def test_only_a_tls_record_header_begins_a_handshake():
    assert begins_tls(b"\x16\x03\x01\x02\x00")
    assert begins_tls(b"\x16")  # one byte so far: it may yet be
    assert not begins_tls(b"")
    assert not begins_tls(b"GET / HTTP/1.1\r\n")
    assert not begins_tls(b"\x16\x07")


def test_first_bytes_are_peeked_not_taken():
    left, right = socket.socketpair()
    try:
        left.setblocking(False)
        assert first_bytes(left) is None  # nothing sent yet
        right.sendall(b"\x16\x03\x01")
        assert first_bytes(left) == b"\x16\x03\x01"
        assert left.recv(8) == b"\x16\x03\x01"  # still there to be read
        right.close()
        assert first_bytes(left) == b""  # its peer closed it
    finally:
        left.close()


def test_a_tls_record_is_whole_once_the_length_its_header_announces_has_come():
    hello = b"\x16\x03\x01\x02\x00" + b"\x01" * 0x200
    assert whole_record(hello) and whole_record(hello + b"more")
    assert not whole_record(hello[:-1]) and not whole_record(hello[:4])


def test_a_requests_head_ends_after_its_blank_line():
    assert ends_request(b"CONNECT a:1 HTTP/1.1\r\nHost: a:1\r\n\r\n\x16") == 35
    assert ends_request(b"CONNECT a:1 HTTP/1.1\r\nHost: a:1\r\n") is None
