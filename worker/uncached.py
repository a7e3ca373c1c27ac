"""Reading files around the OS page cache, so that what a worker reads costs only the memory it
reads into: `O_DIRECT` on Linux, `F_NOCACHE` on macOS, else `posix_fadvise(DONTNEED)`; the
reader pool, the store's checksums, the scrub and the transfers all read through here."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffer addresses aligned to the block size

if sys.platform == "darwin":
    import fcntl

    _F_NOCACHE: int | None = getattr(fcntl, "F_NOCACHE", 48)
else:
    _F_NOCACHE = None


def round_up(value: int, to: int = ALIGN) -> int:
    return -(-value // to) * to


@dataclass(frozen=True)
class OpenFile:
    fd: int
    direct: bool  # O_DIRECT: offsets, lengths and buffers must be ALIGN-ed
    drop_after: bool  # no way to bypass the cache at open: drop the pages after reading


def open_uncached(path: Path) -> OpenFile:
    """Open for reading without filling the OS page cache, as far as the platform allows."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return OpenFile(os.open(path, os.O_RDONLY | direct), True, False)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: this file system refuses O_DIRECT (tmpfs)
                raise
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    if _F_NOCACHE is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, _F_NOCACHE, 1)
            return OpenFile(fd, False, False)
    return OpenFile(fd, False, hasattr(os, "posix_fadvise"))


def read_into(file: OpenFile, view: memoryview, offset: int) -> int:
    """Fill `view` from `offset` with positioned reads; returns the bytes read (short at EOF)."""
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):
            got = os.preadv(file.fd, [view[done:]], offset + done)
        else:  # the descriptor is this thread's own, so seeking is safe
            os.lseek(file.fd, offset + done, os.SEEK_SET)
            if hasattr(os, "readv"):
                got = os.readv(file.fd, [view[done:]])
            else:  # no scatter reads (Windows): one copy more
                data = os.read(file.fd, len(view) - done)
                got = len(data)
                view[done : done + got] = data
        done += got
        if got == 0 or (file.direct and got % ALIGN):  # end of file
            break
    if file.drop_after:
        os.posix_fadvise(file.fd, offset, done, os.POSIX_FADV_DONTNEED)
    return done


def read_file(path: Path, buffer: memoryview, size: int) -> None:
    """Read a whole file of `size` bytes into `buffer`: page-aligned (an mmap) and at least
    round_up(size) long, as O_DIRECT needs."""
    file = open_uncached(path)
    try:
        got = read_into(file, buffer[: round_up(size) if file.direct else size], 0)
    finally:
        os.close(file.fd)
    if got != size:
        raise OSError(errno.EIO, f"read {got} bytes, expected {size}")


def sha256_uncached(
    path: Path, size: int, chunk: int = 8 << 20, pace: Callable[[int], None] | None = None
) -> str:
    """The file's SHA-256, read around the page cache (so checking a store does not fill it
    and what is checked is what the drive holds). `pace`, if given, is called with the bytes
    of each block read (the scrub sleeps there to keep to its rate)."""
    digest = hashlib.sha256()
    buffer = mmap.mmap(-1, chunk)
    file = open_uncached(path)
    try:
        view = memoryview(buffer)
        offset = 0
        while offset < size:
            got = read_into(file, view, offset)
            if got == 0:
                break
            digest.update(view[: min(got, size - offset)])
            offset += got
            if pace is not None:
                pace(got)
        view.release()
    finally:
        os.close(file.fd)
        buffer.close()
    return digest.hexdigest()


def file_problem(
    path: Path, size: int, sha256: str, *, pace: Callable[[int], None] | None = None
) -> str | None:
    """Why the file at `path` is not the manifest's (`size` bytes, `sha256`) on the drive
    now, or None when it is. A file replaced while it was read (a push renaming a fresh copy
    over it) is not blamed: None, it is checked the next time."""
    try:
        before = os.stat(path)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if before.st_size != size:
        return f"it has {before.st_size} bytes, the manifest says {size}"
    try:
        if sha256_uncached(path, size, pace=pace) == sha256:
            return None
        after = os.stat(path)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    same = (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    return "checksum does not match the manifest" if same else None
