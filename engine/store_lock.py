"""Who is using a store folder: a process serving it (a worker, or a coordinator's --local-store)
holds a shared lock on its lock file and the serving lock alone, with its PID in it; `shoal
shard` writing it an exclusive one. flock's locks go with the process, even on kill -9."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable
from pathlib import Path

from engine.errors import ShoalError

LOCK_NAME = ".shoal-lock"
SERVING_NAME = ".shoal-serving.pid"  # "PID ROLE" of the one process serving the store
WORKER = "shoal-worker"
COORDINATOR = "shoal --local-store"


def _try_lock(folder: Path, mode: int, name: str = LOCK_NAME) -> int | None:
    """An open descriptor of the folder's lock file `name`, locked in `mode`; None if another
    process holds a lock that conflicts."""
    fd = os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def hold_for_serving(folders: Iterable[Path], role: str = WORKER) -> list[int]:
    """Shared locks on the store folders a process serves (`role`: WORKER or COORDINATOR), held
    until it exits (the descriptors are kept open on purpose). Refused while `shoal shard`
    writes one of them, or while another process, of either role, serves one."""
    held = []
    for folder in folders:
        try:
            fd = _try_lock(Path(folder), fcntl.LOCK_SH)
        except OSError:
            continue  # a read-only drive, or no folder (the scan says so): nobody writes it
        if fd is None:
            release(held)
            raise ShoalError(f"`shoal shard` is writing {folder} now; start the {role} when "
                             "it has finished")
        held.append(fd)
        alone = _try_lock(Path(folder), fcntl.LOCK_EX, SERVING_NAME)
        if alone is None:
            release(held)
            pid, _, other = (Path(folder) / SERVING_NAME).read_text().strip().partition(" ")
            pid = pid or "unknown"
            raise ShoalError(
                f"{folder} is already served by {other or 'a Shoal process'} PID {pid}; this "
                f"{role} (PID {os.getpid()}) stops: two processes serving one store would each "
                f"move and count its experts without the other knowing. Stop PID {pid} "
                f"first, or give this {role} another store"
            )
        os.ftruncate(alone, 0)
        os.write(alone, f"{os.getpid()} {role}\n".encode())
        held.append(alone)
    return held


def claim_for_writing(folders: Iterable[Path]) -> list[int]:
    """Exclusive locks on store folders `shoal shard` is about to write (made if missing);
    refused, naming them, when a running worker serves any of them."""
    held, served = [], []
    for folder in folders:
        Path(folder).mkdir(parents=True, exist_ok=True)
        fd = _try_lock(Path(folder), fcntl.LOCK_EX)
        if fd is None:
            served.append(str(folder))
        else:
            held.append(fd)
    if served:
        release(held)
        raise ShoalError(
            f"a running shoal-worker serves {', '.join(served)}: `shoal shard` never writes "
            "into a store a live worker serves. Stop that worker first, or shard into "
            "another folder"
        )
    return held


def release(held: Iterable[int]) -> None:
    for fd in held:
        os.close(fd)
