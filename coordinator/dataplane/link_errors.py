"""How a failed call to a worker reads for the user: one table (`ErrorWording`) for every
call on a link, gRPC's or an expert lane's; a worker nothing answers for, in the words every
surface uses (`unreachable_reason`, `dead_worker`); and why a worker cannot serve this model."""

from __future__ import annotations

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


REFUSED = "connection refused at once: nothing listens on that port"


def unreachable_reason(cause: str, timeout: float | None = None) -> str:
    """Why nothing answers at a worker's address, in plain words, from gRPC's details of a
    failed connection ("failed to connect to all addresses; last error: ...") or a socket
    error's text: doctor, `shoal workers`, /health, 503 bodies and every log say it so."""
    lower = cause.lower()
    if "connection refused" in lower:
        return REFUSED
    if any(word in lower for word in ("deadline", "timed out", "timeout")):
        within = f"within {timeout:g} s" if timeout else "in time"
        return f"no answer {within}: the host is off, asleep or firewalled"
    last = cause.rsplit(": ", 1)[-1].strip(" []")  # gRPC's details end with the socket's words
    return f"cannot connect: {last[:1].lower()}{last[1:]}" if last else "cannot connect"


def dead_worker(node_id: str, address: str, reason: str) -> str:
    """A worker nothing answers for, named by its node id where it has one of its own."""
    name = address if node_id in ("", address) else f"{node_id} at {address}"
    return f"worker {name} is unreachable: {reason}"


class Unreachable(Unavailable):
    """Nothing answered at a worker's address; `reason` is unreachable_reason's words."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(dead_worker(address, address, reason))
        self.reason = reason


def reason_of(error: ShoalError | str, address: str = "") -> str:
    """What a member's `detail` keeps of a failure (an error or its message): an unreachable
    worker's reason alone, else the message less a lead naming the worker at `address` (the
    surfaces name it once)."""
    if isinstance(error, Unreachable):
        return error.reason
    message = str(error)
    for lead in (f"worker {address} failed: ", f"worker {address}: "):
        if address and message.startswith(lead):
            return message[len(lead):]
    return message


@dataclass(frozen=True)
class ErrorWording:
    """How one kind of call on a link words a failed gRPC call for the user.

    A status code in `refusals` is the worker's own answer: it raised that ShoalError there
    (proto.ERROR_CODES read back; FAILED_PRECONDITION stands for any other), and the details
    are its message. Any other code means the call did not get through: Unavailable, worded
    by `failed`; with `identity`, a refused credential or TLS handshake is Unauthenticated
    instead (the worker belongs to another cluster, or the clocks disagree). A connection
    that could not be made is Unreachable, in plain words; with `silence`, so is a deadline
    that passed (a health check: nothing answered at all).
    """

    refusals: frozenset[grpc.StatusCode] = frozenset()
    failed: str = "worker {address}: {code}: {details}"
    identity: bool = False
    silence: bool = False


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
HEALTH = ErrorWording(identity=True, silence=True)
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


_NOT_CONNECTED = ("failed to connect", "connection refused", "no route to host",
                  "network is unreachable", "dns resolution failed", "errors resolving",
                  "connections to all backends failing")


def error_for(error: grpc.RpcError, address: str, wording: ErrorWording = CALL,
              timeout: float | None = None) -> ShoalError:
    """A failed call to the worker at `address` as the ShoalError the user is shown
    (`timeout`: the call's deadline, named when nothing answered within it)."""
    return error_for_code(error.code(), error.details() or error.code().name, address, wording,
                          timeout)


def error_for_code(code: grpc.StatusCode, details: str, address: str,
                   wording: ErrorWording = CALL, timeout: float | None = None) -> ShoalError:
    """The same, from a status code and its details (an expert lane's ERROR frame)."""
    if wording.identity and refused_certificate(details):
        return Unauthenticated(OTHER_IDENTITY.format(address=address))
    if code == grpc.StatusCode.UNAVAILABLE and any(
            words in details.lower() for words in _NOT_CONNECTED) \
            or wording.silence and code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Unreachable(address, unreachable_reason(details, timeout))
    if code in wording.refusals:
        return (error_class_for(code) or ShoalError)(f"worker {address}: {details}")
    refused = wording.identity and code == grpc.StatusCode.UNAUTHENTICATED
    text = wording.failed.format(address=address, code=code.name, details=details)
    if details.replace(" ", "_").upper() == code.name:  # "Deadline Exceeded": the code again
        text = text.replace(f"{code.name}: {details}", details.lower())
    return (Unauthenticated if refused else Unavailable)(text)
