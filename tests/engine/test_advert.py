"""The Bonjour TXT record: public facts only, and a round trip through zeroconf's bytes."""

import pytest

from engine.advert import Advert, check_name, decode_txt, encode_txt, inventory_digest
from engine.errors import InvalidInput

ADVERT = Advert(
    node_id="studio-3f9a1c", cluster="desk", protocol=1, model="ab" * 32,
    inventory=inventory_digest([(0, 1), (1, 2)]), experts=2, memory_budget=64 << 30,
    free_disk=512 << 30,
)


def test_txt_round_trip_as_zeroconf_delivers_it():
    txt = encode_txt(ADVERT)
    assert all(isinstance(v, str) and len(k) + len(v) < 255 for k, v in txt.items())
    assert decode_txt({k.encode(): v.encode() for k, v in txt.items()}) == ADVERT
    assert decode_txt(txt) == ADVERT


def test_txt_carries_no_secret_and_nothing_unexpected():
    assert set(encode_txt(ADVERT)) == {
        "txtvers", "id", "cluster", "proto", "model", "inv", "experts", "mem", "disk"
    }


def test_malformed_records_are_refused_with_the_reason():
    txt = {k.encode(): v.encode() for k, v in encode_txt(ADVERT).items()}
    with pytest.raises(InvalidInput, match="lacks the key 'cluster'"):
        decode_txt({k: v for k, v in txt.items() if k != b"cluster"})
    with pytest.raises(InvalidInput, match="malformed number"):
        decode_txt({**txt, b"proto": b"one"})
    assert decode_txt({**txt, b"mem": None}).memory_budget == 0


def test_inventory_digest_ignores_order_and_sees_changes():
    assert inventory_digest([(1, 2), (0, 1)]) == inventory_digest([(0, 1), (1, 2)])
    assert inventory_digest([(0, 1)]) != inventory_digest([(0, 2)])


@pytest.mark.parametrize("name", ["default", "studio-1", "Mac_mini.2", "a"])
def test_plain_names_are_accepted(name):
    assert check_name(name, "node id") == name


@pytest.mark.parametrize("name", ["", "-x", "two words", "x" * 64, "café"])
def test_other_names_are_refused(name):
    with pytest.raises(InvalidInput, match="node id"):
        check_name(name, "node id")
