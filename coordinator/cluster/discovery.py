"""Where workers come from: Bonjour browsing of `_shoal._tcp.local.`, or a cluster config file
written by hand (cluster-configs/*.toml); both give `Candidate`s, plain descriptions of a
worker before any connection, which the membership then connects to."""

from __future__ import annotations

import sys
import threading
import tomllib
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

from engine.advert import SERVICE_TYPE, Advert, check_name, decode_txt
from engine.errors import InvalidInput, NotFound, ShoalError

RESOLVE_TIMEOUT_MS = 3000
RESOLVE_ATTEMPTS = 2


@dataclass(frozen=True)
class Candidate:
    """A worker as a source describes it: where it may be reached, and what it announced."""

    key: str  # the Bonjour instance name, or the configured address: unique per worker
    endpoints: tuple[tuple[str, int], ...]  # (host, port), best reachable one is chosen
    advert: Advert | None = None  # Bonjour only
    interface: str | None = None  # preferred interface of ours, from a cluster config
    node_id: str | None = None  # the name a cluster config gives it, until it answers


def same_cluster(advert: Advert, cluster: str) -> bool:
    """Workers of other clusters are not ours to list or use."""
    return advert.cluster == cluster


# ---------------------------------------------------------------------------------------
# Cluster config files


@dataclass(frozen=True)
class ClusterConfig:
    name: str
    interface: str | None  # preferred interface for every worker, unless it names its own
    workers: tuple[Candidate, ...]
    # [coordinator]: store folders of the coordinator's own Mac, served in its process
    local_stores: tuple[Path, ...] = ()
    memory_budget: str | None = None  # for those, in shoal-worker's forms
    # [[workers]] memory_budget and read_speed as written, for placement (`shoal shard`,
    # `shoal rebalance`): (node_id or first address, memory_budget, read_speed)
    members: tuple[tuple[str, str | None, str | None], ...] = ()


_TOP_KEYS = {"name", "interface", "workers", "coordinator"}
_WORKER_KEYS = {"address", "addresses", "interface", "node_id", "memory_budget", "read_speed"}
_COORDINATOR_KEYS = {"stores", "memory_budget"}


def parse_cluster_config(data: Mapping, origin: str, folder: Path | None = None) -> ClusterConfig:
    """A cluster config, already parsed from TOML: name, interface, [[workers]] with
    `address = "HOST:PORT"` (or `addresses = [...]`, the path then chosen as for Bonjour),
    and [coordinator] with the `stores` of the coordinator's own Mac (relative to `folder`,
    the config's) and their `memory_budget`."""
    _known_keys(data, _TOP_KEYS, origin)
    name = data.get("name")
    if not isinstance(name, str):
        raise InvalidInput(f'{origin}: give the cluster a name (name = "desk")')
    check_name(name, f"{origin}: cluster name")
    interface = _optional_str(data, "interface", origin)
    stores, memory_budget = _coordinator_table(data.get("coordinator", {}), origin, folder)
    workers = data.get("workers", [])
    if not isinstance(workers, list) or not (workers or stores):
        raise InvalidInput(f'{origin}: list the workers, each as [[workers]] address = "HOST:PORT"'
                           " (or the coordinator's own stores, [coordinator] stores = [...])")
    candidates, members = [], []
    for index, worker in enumerate(workers):
        where = f"{origin}: worker {index + 1}"
        if not isinstance(worker, dict):
            raise InvalidInput(f"{where}: expected a [[workers]] table")
        _known_keys(worker, _WORKER_KEYS, where)
        addresses = worker.get("addresses", [worker.get("address")])
        if "address" in worker and "addresses" in worker:
            raise InvalidInput(f"{where}: give address or addresses, not both")
        if not isinstance(addresses, list) or not addresses or not all(
            isinstance(a, str) for a in addresses
        ):
            raise InvalidInput(f'{where}: needs address = "HOST:PORT"')
        node_id = _optional_str(worker, "node_id", where)
        candidates.append(Candidate(
            key=addresses[0],
            endpoints=tuple(parse_endpoint(a, where) for a in addresses),
            interface=_optional_str(worker, "interface", where) or interface,
            node_id=check_name(node_id, f"{where}: node_id") if node_id else None,
        ))
        members.append((node_id or addresses[0], _optional_str(worker, "memory_budget", where),
                        _optional_str(worker, "read_speed", where)))
    keys = [c.key for c in candidates]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise InvalidInput(f"{origin}: worker {repeated[0]} is listed twice")
    return ClusterConfig(name, interface, tuple(candidates), stores, memory_budget,
                         tuple(members))


def _known_keys(table: Mapping, keys: set[str], where: str) -> None:
    """Refuse, naming them, the settings a table of the file does not take (a misspelt one
    would otherwise be ignored without a word)."""
    unknown = set(table) - keys
    if unknown:
        raise InvalidInput(f"{where}: unknown setting(s) {', '.join(sorted(unknown))}")


def _coordinator_table(
    table: object, origin: str, folder: Path | None
) -> tuple[tuple[Path, ...], str | None]:
    where = f"{origin}: [coordinator]"
    if not isinstance(table, dict):
        raise InvalidInput(f"{where}: expected a table")
    _known_keys(table, _COORDINATOR_KEYS, where)
    stores = table.get("stores", [])
    if not isinstance(stores, list) or not all(isinstance(s, str) and s for s in stores):
        raise InvalidInput(f'{where}: stores must be a list of folders, e.g. ["/Volumes/A/w0"]')
    paths = tuple((folder or Path()) / Path(s).expanduser() for s in stores)
    memory_budget = _optional_str(table, "memory_budget", where)
    if memory_budget and not paths:
        raise InvalidInput(f"{where}: memory_budget needs stores")
    return paths, memory_budget


def parse_endpoint(text: str, where: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) as (host, port); refused naming what is wrong."""
    host, colon, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if port.isdigit() and not 0 < int(port) < 65536:
        raise InvalidInput(f"{where}: address {text!r}: port {int(port)} is out of range "
                           "(1-65535)")
    if not colon or not host or not port.isdigit():
        raise InvalidInput(f"{where}: address {text!r} is not HOST:PORT (e.g. "
                           "mac-a.local:50551)")
    return host, int(port)


def _optional_str(table: Mapping, key: str, where: str) -> str | None:
    value = table.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidInput(f"{where}: {key} must be a string")
    return value or None


def read_cluster_config(path: Path) -> ClusterConfig:
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise NotFound(f"no cluster config at {path} (see cluster-configs/ for examples)") from None
    except OSError as e:
        raise ShoalError(f"cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise InvalidInput(f"{path} is not valid TOML: {e}") from None
    return parse_cluster_config(data, str(path), Path(path).parent)


# ---------------------------------------------------------------------------------------
# Bonjour


class Browser:
    """Browses `_shoal._tcp.local.` and hands each worker of `cluster` to `offer`, and each
    worker that says goodbye to `withdraw`. Zeroconf is bound to `interfaces` (IPv4 addresses
    of ours) or to every interface. Resolution runs off zeroconf's own threads."""

    def __init__(
        self,
        cluster: str,
        offer: Callable[[Candidate], None],
        withdraw: Callable[[str], None],
        *,
        interfaces: list[str] | None = None,
        log: Callable[[str], None] = lambda message: print(message, file=sys.stderr),
    ) -> None:
        from zeroconf import InterfaceChoice, IPVersion, ServiceBrowser, Zeroconf

        self.cluster = cluster
        self._offer, self._withdraw, self._log = offer, withdraw, log
        self._pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="resolve")
        self._zc = Zeroconf(
            interfaces=interfaces or InterfaceChoice.All, ip_version=IPVersion.V4Only
        )
        self._closed = False
        self._resolving: set[str] = set()  # names whose resolution has not finished
        self._lock = threading.Lock()
        # Workers of other clusters, seen and ignored: named when ours cannot be found.
        self.elsewhere: dict[str, tuple[str, str]] = {}  # name -> (cluster, "NODE at ADDRESS")
        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[self._changed])

    def _changed(
        self, zeroconf: object, service_type: str, name: str, state_change: object
    ) -> None:
        from zeroconf import ServiceStateChange

        if self._closed:
            return
        if state_change is ServiceStateChange.Removed:
            self._withdraw(name)
        else:
            with self._lock:
                self._resolving.add(name)
            self._pool.submit(self._resolve_then_done, name)

    def resolving(self) -> bool:
        """Whether an announcement heard is still being resolved (so a listing that stopped
        now would miss a worker that is there)."""
        with self._lock:
            return bool(self._resolving)

    def _resolve_then_done(self, name: str) -> None:
        try:
            self._resolve(name)
        finally:
            with self._lock:
                self._resolving.discard(name)

    def _resolve(self, name: str) -> None:
        from zeroconf import IPVersion, ServiceInfo

        info = ServiceInfo(SERVICE_TYPE, name)
        # A busy host can miss one answer: ask twice before giving the worker up.
        for _ in range(RESOLVE_ATTEMPTS):
            if self._closed:
                return
            if info.request(self._zc, RESOLVE_TIMEOUT_MS):
                break
        else:
            self._log(f"shoal: {name} announced itself but did not answer its resolution "
                      f"within {RESOLVE_ATTEMPTS} x {RESOLVE_TIMEOUT_MS / 1e3:g} s")
            return
        try:
            advert = decode_txt(info.properties)
        except InvalidInput as e:
            self._log(f"shoal: ignoring {name}: {e}")
            return
        addresses = info.parsed_addresses(IPVersion.V4Only)
        if not same_cluster(advert, self.cluster):
            at = ", ".join(f"{a}:{info.port}" for a in addresses)
            self.elsewhere[name] = (advert.cluster, f"{advert.node_id} at {at}")
            return
        if not addresses or not info.port:
            return
        self._offer(Candidate(name, tuple((a, info.port) for a in addresses), advert))

    def close(self) -> None:
        self._closed = True
        self._browser.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._zc.close()
