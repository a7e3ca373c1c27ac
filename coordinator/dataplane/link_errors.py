"""How a failed call to a worker reads for the user: one table (`ErrorWording`) for every
call on a link, gRPC's or an expert lane's; and why a worker cannot serve this model."""

from __future__ import annotations

import re
from dataclasses import dataclass

import grpc

from engine.errors import ShoalError, Unauthenticated, Unavailable
from engine.manifest import ExpertKey, Manifest
from proto import ERROR_CODES, PROTOCOL_VERSION, error_class_for, shoal_pb2


def incompatibility(
    address: str, protocol: int, fingerprint: str, manifest: Manifest | None
) -> str | None:
    """Why a worker (its inventory or its Bonjour advert) cannot serve this model, or None.
    Without a manifest (`shoal workers`) only the protocol is judged."""
    if protocol != PROTOCOL_VERSION:
        return (
            f"worker {address} speaks protocol {protocol}, this coordinator "
            f"{PROTOCOL_VERSION}: upgrade Shoal on both"
        )
    if manifest is not None and fingerprint != manifest.fingerprint:
        return (
            f"worker {address} serves a different model ({fingerprint[:12]}, expected "
            f"{manifest.model_type} {manifest.fingerprint[:12]})"
        )
    return None


def held(inventory: shoal_pb2.Inventory) -> frozenset[ExpertKey]:
    return frozenset((h.layer, h.expert) for h in inventory.experts)


@dataclass(frozen=True)
class ErrorWording:
    """How one kind of call on a link words a failed gRPC call for the user.

    A status code in `refusals` is the worker's own answer: it raised that ShoalError there
    (proto.ERROR_CODES read back; FAILED_PRECONDITION stands for any other), and the details
    are its message. Any other code means the call did not get through: Unavailable, worded
    by `failed`; with `identity`, a refused credential or TLS handshake is Unauthenticated
    instead (the worker belongs to another cluster, or the clocks disagree).
    """

    refusals: frozenset[grpc.StatusCode] = frozenset()
    failed: str = "worker {address}: {code}: {details}"
    identity: bool = False


_REFUSALS = frozenset(code for _, code in ERROR_CODES) | {grpc.StatusCode.FAILED_PRECONDITION}
OTHER_IDENTITY = (
    "worker {address} refused this cluster's TLS identity or holds another's: copy the same "
    "cluster secret file (shoal cluster-init) to every Mac"
)
# The calls of a link: the handshake and the counters are the worker's bookkeeping, which it
# never refuses; any other call (heat, expert files) answers with the worker's refusals; on
# the Compute stream only "an expert moved" is an answer (see Cluster.reload), any other
# failure loses the worker for this call.
INVENTORY = ErrorWording(identity=True)
STATS = ErrorWording()
HEALTH = ErrorWording(identity=True)
CALL = ErrorWording(_REFUSALS, failed="worker {address}: {details}")
STREAM = ErrorWording(frozenset({grpc.StatusCode.ABORTED}),
                 failed="worker {address} failed: {code}: {details}")


# What a TLS handshake's failure names when one side refused the other's certificate (grpcio
# says "Tls handshake failed ... certificate signature failure", the ssl module names the
# check or the peer's alert); a handshake cut, reset or timed out names none of them.
_CERTIFICATE_WORDS = ("CERTIFICATE", "SIGNATURE", "UNKNOWN_CA", "DECRYPT_ERROR",
                      "ACCESS_DENIED")
_HANDSHAKE_WORDS = ("HANDSHAKE FAILED", "ALERT", "VERIFY_FAILED")


def refused_certificate(details: str) -> bool:
    """Whether a failed TLS handshake (grpcio's details, or an ssl error's reason) was one
    side refusing the other's certificate: another cluster's identity."""
    upper = details.upper()
    return any(word in upper for word in _HANDSHAKE_WORDS) and any(
        word in upper for word in _CERTIFICATE_WORDS)


# How grpcio says a connection could not be made: the OS's reason comes last, after the
# address and grpcio's own codes ("failed to connect to all addresses; last error: UNKNOWN:
# ipv4:h:1: Failed to connect to remote host: Connection refused").
_UNREACHED = re.compile(r"failed to connect to all addresses|connections to all backends "
                        r"failing|errors resolving|DNS resolution failed", re.IGNORECASE)


def unreached(details: str) -> str | None:
    """The one reason grpcio's `details` give for a connection it could not make (as in
    "connection refused"), or None when they tell of something else."""
    if not _UNREACHED.search(details):
        return None
    last = details.rsplit(": ", 1)[-1].strip(" []")
    return last[:1].lower() + last[1:] if last else "no connection"


def reason_of(message: str, address: str) -> str:
    """What a message about the worker at `address` says after naming it: how a line that
    names the worker itself quotes the message without naming it twice."""
    for lead in (f"worker {address} unreachable: ", f"worker {address} failed: ",
                 f"worker {address}: "):
        if message.startswith(lead):
            return message[len(lead):]
    return message


def error_for(error: grpc.RpcError, address: str, wording: ErrorWording = CALL) -> ShoalError:
    """A failed call to the worker at `address` as the ShoalError the user is shown."""
    return error_for_code(error.code(), error.details() or error.code().name, address, wording)


def error_for_code(code: grpc.StatusCode, details: str, address: str,
                   wording: ErrorWording = CALL) -> ShoalError:
    """The same, from a status code and its details (an expert lane's ERROR frame)."""
    if wording.identity and refused_certificate(details):
        return Unauthenticated(OTHER_IDENTITY.format(address=address))
    reason = unreached(details) if code == grpc.StatusCode.UNAVAILABLE else None
    if reason is not None:  # grpcio's words, not the worker's: it was never reached
        return Unavailable(f"worker {address} unreachable: {reason}")
    if code in wording.refusals:
        return (error_class_for(code) or ShoalError)(f"worker {address}: {details}")
    refused = wording.identity and code == grpc.StatusCode.UNAUTHENTICATED
    text = wording.failed.format(address=address, code=code.name, details=details)
    if details.replace(" ", "_").upper() == code.name:  # "Deadline Exceeded": the code again
        text = text.replace(f"{code.name}: {details}", details.lower())
    return (Unauthenticated if refused else Unavailable)(text)
