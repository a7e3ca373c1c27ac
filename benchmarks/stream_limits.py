"""What makes one process on this machine act as one Mac with one SSD for the streaming
benchmarks: an empty page cache, a cgroup with a memory limit, a read-bandwidth limit and a
CPU share."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

from worker.uncached import open_uncached, read_into

CGROUP_ROOT = Path("/sys/fs/cgroup")


def drop_page_cache(files: list[Path]) -> str:
    """Drop the given files' pages from the OS page cache (each written out first, so none is
    kept dirty): only the benchmark's files, where emptying the whole cache (drop_caches)
    would make every other process on the machine read its own files again."""
    if not hasattr(os, "posix_fadvise"):
        return "nothing (no way to drop the page cache here)"
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED) on every file"


def sequential_bandwidth(folder: Path, size: int = 1 << 30, block: int = 8 << 20) -> float:
    """Bytes/s of one sequential pass over a fresh file on the drive, around the page cache."""
    path = folder / ".shoal-bench-sequential"
    chunk = os.urandom(block)
    with open(path, "wb") as f:
        for _ in range(size // block):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    drop_page_cache([path])
    buffer = mmap.mmap(-1, block)
    view = memoryview(buffer)
    file = open_uncached(path)
    started = time.perf_counter()
    offset = 0
    while got := read_into(file, view, offset):
        offset += got
    elapsed = time.perf_counter() - started
    os.close(file.fd)
    view.release()
    buffer.close()
    path.unlink()
    return offset / elapsed


def block_device(folder: Path) -> str:
    """'MAJOR:MINOR' of the whole disk under `folder` (cgroups throttle disks, not partitions)."""
    dev = os.stat(folder).st_dev
    number = f"{os.major(dev)}:{os.minor(dev)}"
    node = Path("/sys/dev/block") / number
    if (node / "partition").exists():
        return (node.resolve().parent / "dev").read_text().strip()
    return number


# The CPU period a share is cut from, and the weight the benchmark's groups get: the machine
# is shared, so its groups must not be starved by other work (1024 is the default).
CPU_PERIOD_US = 100_000
CPU_SHARES = 8192


def cgroups_available() -> str | None:
    """None where a member's cgroup can be made here, else why not (said by skipping tests)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not root: cgroups need root"
    if (CGROUP_ROOT / "memory" / "cgroup.procs").exists():
        return None
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return None
    return f"no cgroup file system at {CGROUP_ROOT}"


class MemberLimits:
    """A cgroup (v1: memory, blkio, cpu and cpuacct hierarchies; v2: one group) that a command
    joins before it starts: a memory limit, with `read_bps` a read-bandwidth limit on `device`,
    with `cpu` a CPU quota of that many cores (and a high weight: see CPU_SHARES). `kinds` says
    what was set; a limit that could not be set is named in `missing`."""

    def __init__(self, name: str, memory: int | None, read_bps: int | None,
                 device: str | None, cpu: float | None = None) -> None:
        self.groups: list[Path] = []
        self.kinds: list[str] = []
        self.missing: list[str] = []
        self.blkio: Path | None = None
        self.cpu_usage: Path | None = None
        self.cpu_v2 = False
        if (CGROUP_ROOT / "memory" / "cgroup.procs").exists():
            self._v1(name, memory, read_bps, device)
            self._v1_cpu(name, cpu)
        elif (CGROUP_ROOT / "cgroup.controllers").exists():
            self._v2(name, memory, read_bps, device, cpu)
        else:
            self.missing.append("no cgroup file system here: no memory, read or CPU limit")

    def _v1_cpu(self, name: str, cpu: float | None) -> None:
        if not (CGROUP_ROOT / "cpu" / "cgroup.procs").exists():
            self.missing.append("CPU share (no cpu controller)")
            return
        group = self._group(CGROUP_ROOT / "cpu" / name)
        (group / "cpu.shares").write_text(str(CPU_SHARES))
        if cpu is not None:
            (group / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(int(cpu * CPU_PERIOD_US)))
            self.kinds.append("cgroup v1 cpu.cfs_quota_us")
        if (group / "cpuacct.usage").exists():
            self.cpu_usage = group / "cpuacct.usage"
        elif (CGROUP_ROOT / "cpuacct" / "cgroup.procs").exists():
            self.cpu_usage = self._group(CGROUP_ROOT / "cpuacct" / name) / "cpuacct.usage"

    def _group(self, path: Path) -> Path:
        path.mkdir(exist_ok=True)
        self.groups.append(path)
        return path

    def _v1(self, name: str, memory: int | None, read_bps: int | None, device: str | None):
        if memory is not None:
            group = self._group(CGROUP_ROOT / "memory" / name)
            (group / "memory.limit_in_bytes").write_text(str(memory))
            self.kinds.append("cgroup v1 memory.limit_in_bytes")
        if read_bps is not None:
            if device is None or not (CGROUP_ROOT / "blkio" / "cgroup.procs").exists():
                self.missing.append("read limit (no blkio controller or no block device)")
                return
            self.blkio = self._group(CGROUP_ROOT / "blkio" / name)
            (self.blkio / "blkio.throttle.read_bps_device").write_text(f"{device} {read_bps}")
            self.kinds.append("cgroup v1 blkio.throttle.read_bps_device")

    def _v2(self, name: str, memory: int | None, read_bps: int | None, device: str | None,
            cpu: float | None):
        group = self._group(CGROUP_ROOT / name)
        self.cpu_usage, self.cpu_v2 = group / "cpu.stat", True
        try:
            (group / "cpu.weight").write_text(str(1 + (CPU_SHARES - 2) * 9999 // 262142))
            if cpu is not None:
                (group / "cpu.max").write_text(f"{int(cpu * CPU_PERIOD_US)} {CPU_PERIOD_US}")
                self.kinds.append("cgroup v2 cpu.max")
        except OSError:
            self.missing.append("CPU share (cpu controller not enabled for this group)")
        if memory is not None:
            (group / "memory.max").write_text(str(memory))
            self.kinds.append("cgroup v2 memory.max")
        if read_bps is not None:
            try:
                (group / "io.max").write_text(f"{device} rbps={read_bps}")
                self.kinds.append("cgroup v2 io.max")
            except (OSError, TypeError):
                self.missing.append("read limit (io controller not enabled for this group)")

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd` run by a shell that first moves itself into every group."""
        joins = " && ".join(f"echo $$ > {g / 'cgroup.procs'}" for g in self.groups)
        return ["sh", "-c", f'{joins or "true"} && exec "$@"', "sh", *cmd]

    def bytes_read(self) -> int | None:
        """Bytes the group read from its device (v1 blkio's own count)."""
        if self.blkio is None:
            return None
        for line in (self.blkio / "blkio.throttle.io_service_bytes").read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] == "Read":
                return int(parts[2])
        return 0

    def cpu_seconds(self) -> float | None:
        """CPU time the group's processes have used."""
        return None if self.cpu_usage is None else read_cpu_seconds(self.cpu_usage, self.cpu_v2)

    def peak_memory(self) -> int | None:
        for group in self.groups:
            for name in ("memory.max_usage_in_bytes", "memory.peak"):
                if (group / name).exists():
                    return int((group / name).read_text())
        return None

    def close(self) -> None:
        for group in self.groups:
            try:
                group.rmdir()
            except OSError:
                pass


def read_cpu_seconds(usage: Path | None, v2: bool) -> float | None:
    """A cgroup's CPU seconds from its counter file (v1 cpuacct.usage, v2 cpu.stat)."""
    if usage is None or not usage.exists():
        return None
    text = usage.read_text()
    if not v2:
        return int(text) / 1e9
    return next(int(line.split()[1]) / 1e6 for line in text.splitlines()
                if line.startswith("usage_usec"))


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0
