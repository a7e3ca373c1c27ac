"""What a worker tells the local network about itself: the DNS-SD service type and its TXT
record. Only public facts travel here (never the secret); both ends use these functions."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from engine.errors import InvalidInput
from engine.manifest import ExpertKey

SERVICE_TYPE = "_shoal._tcp.local."
TXT_VERSION = "1"
DEFAULT_CLUSTER = "default"
# Node ids and cluster names become DNS-SD instance names and TXT values: keep them plain.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


@dataclass(frozen=True)
class Advert:
    node_id: str
    cluster: str
    protocol: int
    model: str  # the manifest's fingerprint
    inventory: str  # inventory_digest() of the experts held
    experts: int
    memory_budget: int  # bytes
    free_disk: int  # bytes


def check_name(value: str, what: str) -> str:
    """A node id or cluster name: 1-63 letters, digits, '.', '_' or '-', starting alphanumeric."""
    if not _NAME.fullmatch(value):
        raise InvalidInput(
            f"{what} {value!r} is not valid: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def inventory_digest(held: Iterable[ExpertKey]) -> str:
    """A short digest of which (layer, expert) pairs a worker holds, independent of order."""
    text = ";".join(f"{layer}/{expert}" for layer, expert in sorted(held))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# TXT keys, each a short string as DNS-SD recommends: txtvers (this key set's version), id
# (node id), cluster, proto (protocol version), model (fingerprint), inv (digest of the held
# (layer, expert) pairs), experts (how many held), mem (memory budget) and disk (free bytes).
def encode_txt(advert: Advert) -> dict[str, str]:
    return {
        "txtvers": TXT_VERSION,
        "id": advert.node_id,
        "cluster": advert.cluster,
        "proto": str(advert.protocol),
        "model": advert.model,
        "inv": advert.inventory,
        "experts": str(advert.experts),
        "mem": str(advert.memory_budget),
        "disk": str(advert.free_disk),
    }


def decode_txt(properties: Mapping[bytes | str, bytes | str | None]) -> Advert:
    """The Advert in a TXT record as python-zeroconf hands it over (bytes keys and values).

    Raises InvalidInput for a record that is not a Shoal worker's (missing or malformed keys).
    """
    text = {
        (k.decode("utf-8", "replace") if isinstance(k, bytes) else k): (
            v.decode("utf-8", "replace") if isinstance(v, bytes) else (v or "")
        )
        for k, v in properties.items()
    }
    try:
        return Advert(
            node_id=text["id"],
            cluster=text["cluster"],
            protocol=int(text["proto"]),
            model=text["model"],
            inventory=text.get("inv", ""),
            experts=int(text.get("experts") or 0),
            memory_budget=int(text.get("mem") or 0),
            free_disk=int(text.get("disk") or 0),
        )
    except KeyError as e:
        raise InvalidInput(f"TXT record lacks the key {e.args[0]!r}") from None
    except ValueError as e:
        raise InvalidInput(f"TXT record has a malformed number ({e})") from None
