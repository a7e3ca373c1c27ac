"""The cluster secret file (the secret, and the cluster's TLS identity, engine/tls.py) and
the per-call credential derived from it; the secret itself never travels."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path

from engine.errors import ShoalError, Unauthenticated
from engine.tls import Identity, make_identity, read_identity

# Each call carries `shoal-auth: <time>.<nonce>.<hmac>`, an HMAC-SHA256 of the time, nonce,
# method and (but for the inventory and the liveness check) the worker's node id, under the
# secret; a worker accepts it within a freshness window and refuses a nonce it has seen while it
# could be fresh. Links are TLS with both ends' certificates checked, so it is never replayable.
METADATA_KEY = "shoal-auth"
SECRET_ENV = "SHOAL_SECRET_FILE"
FRESHNESS_SECONDS = 300.0


def default_secret_path() -> Path:
    config_home = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config_home) / "shoal" / "secret"


def secret_path(explicit: str | os.PathLike | None = None) -> Path:
    """--secret-file, else $SHOAL_SECRET_FILE, else the default path under the config folder."""
    if explicit:
        return Path(explicit)
    if os.environ.get(SECRET_ENV):
        return Path(os.environ[SECRET_ENV])
    return default_secret_path()


def create_secret(path: Path, *, force: bool = False) -> Path:
    """Write a new random secret readable only by its owner (mode 0600), atomically.

    The bytes go to a fresh temporary file created exclusively with mode 0600 (never one
    left over, whose mode an O_TRUNC would have kept) and renamed over `path`, so no moment
    and no earlier file lets anyone else read the secret.
    """
    if path.exists() and not force:
        raise ShoalError(
            f"a cluster secret already exists at {path}; copy that file to the other Macs, "
            "or pass --force to replace it (every worker then needs the new one)"
        )
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # A leftover of older versions, which wrote through this name and kept its mode.
    path.with_name(path.name + ".tmp").unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n" + make_identity().to_pem())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def ensure_secret(path: Path) -> Path:
    """A secret of Shoal's own (the demo's, the bench's) at `path`, made anew when missing or
    from before links were encrypted. Never for a user's cluster secret: replacing that one
    would lock every other Mac out."""
    if not path.exists() or load_secret(path).identity is None:
        create_secret(path, force=True)
    return path


def secret_mode(path: Path) -> int:
    """The permission bits of the secret file (0600 when only its owner may read it)."""
    return stat.S_IMODE(os.stat(path).st_mode)


def load_secret(path: Path) -> bytes:
    """The cluster secret at `path`; refused when others than its owner may read or change
    it (as ssh refuses such a private key): anyone who reads it can act as a coordinator."""
    try:
        mode = secret_mode(path)
        text = path.read_text().strip()
    except FileNotFoundError:
        raise ShoalError(
            f"no cluster secret at {path}: run `shoal cluster-init` on one machine and copy "
            "the file to the same place on every Mac (or pass --secret-file / set "
            f"{SECRET_ENV})"
        ) from None
    except OSError as e:
        raise ShoalError(f"cannot read the cluster secret {path}: {e.strerror}") from None
    if mode & 0o077 and os.name == "posix":
        raise ShoalError(
            f"the cluster secret {path} has mode {mode:04o}: other users of this machine can "
            f"read or change it; run `chmod 600 {path}` (and check who may have copied it)"
        )
    first = text.split("\n", 1)[0].strip()
    if len(first) < 32:
        raise ShoalError(f"the cluster secret in {path} is too short (at least 32 characters)")
    return Secret(first.encode(), read_identity(text), path)


class Secret(bytes):
    """The secret's bytes (what credentials are made from), with the TLS identity read from
    the same file: None in a file written by a Shoal before links were encrypted."""

    identity: Identity | None
    path: Path | None

    def __new__(cls, value: bytes, identity: Identity | None = None,
                path: Path | None = None) -> Secret:
        made = super().__new__(cls, value)
        made.identity, made.path = identity, path
        return made

    def require_identity(self) -> Identity:
        if self.identity is None:
            where = self.path or "the cluster secret file"
            raise ShoalError(
                f"{where} holds no TLS identity (it was made by an older `shoal cluster-init`):"
                " run `shoal cluster-init --force` once and copy the new file to every Mac"
            )
        return self.identity


# A coordinator's first call, GetInventory, learns the worker's node id, so it (and the
# liveness check, which needs no credential at all) takes one made for no worker in
# particular; every other call's credential is bound to the node id of the worker it was made
# for, so that a credential seen by one worker cannot be presented to another.
HEALTH_CHECK = "/grpc.health.v1.Health/Check"  # answered without a credential too
UNBOUND_METHODS = frozenset({"/shoal.v1.ExpertService/GetInventory", HEALTH_CHECK})


def _mac(secret: bytes, stamp: str, nonce: str, method: str, node: str = "") -> str:
    # '@' is in neither a method's path nor a node id (engine/advert.py: check_name)
    message = f"{stamp}.{nonce}.{method}" + (f"@{node}" if node else "")
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


def make_credential(secret: bytes, method: str, *, node: str = "",
                    now: float | None = None) -> str:
    """A credential for one call of `method` to the worker whose node id is `node` (""
    binds it to none: accepted only for UNBOUND_METHODS)."""
    stamp = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(12)
    return f"{stamp}.{nonce}.{_mac(secret, stamp, nonce, method, node)}"


class CredentialChecker:
    """Verifies credentials for one worker (`node`, its node id, set before it serves);
    remembers recent nonces to refuse replays."""

    def __init__(self, secret: bytes, *, window: float = FRESHNESS_SECONDS,
                 node: str = "") -> None:
        self._secret = secret
        self._window = window
        self.node = node
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, credential: str | None, method: str, *, now: float | None = None) -> None:
        if not credential:
            raise Unauthenticated("missing shoal-auth credential: is the cluster secret set?")
        now = time.time() if now is None else now
        try:
            whole, frac, nonce, mac = credential.split(".")
            stamp = f"{whole}.{frac}"
            issued = float(stamp)
        except ValueError:
            raise Unauthenticated("malformed shoal-auth credential") from None
        bound = bool(self.node) and hmac.compare_digest(
            mac, _mac(self._secret, stamp, nonce, method, self.node))
        if not bound:
            unbound = hmac.compare_digest(mac, _mac(self._secret, stamp, nonce, method))
            if unbound and method not in UNBOUND_METHODS and self.node:
                raise Unauthenticated(
                    f"a credential for {method.rsplit('/', 1)[-1]} must be made for this "
                    f"worker ({self.node}): it was made for none")
            if not unbound:
                raise Unauthenticated(
                    "credential does not match this worker's cluster secret, or was made for "
                    "another worker (copy the same secret file to every machine)"
                )
        if abs(now - issued) > self._window:
            raise Unauthenticated(
                f"credential is {abs(now - issued):.0f} s old or early: check the clocks "
                f"(allowed skew {self._window:.0f} s)"
            )
        with self._lock:
            # A credential is fresh for `window` either side of its stamp, so a nonce is kept
            # for twice that: however skewed the clocks, it is never accepted twice.
            while self._seen and next(iter(self._seen.values())) < now - 2 * self._window:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise Unauthenticated("credential was already used (replayed call refused)")
            self._seen[nonce] = now
