"""What the machine did during a benchmark run: GPU busy fraction and power (NVML), and a server process's CPU
time per thread (``/proc``). Both are read by the load generator, outside the server, so the server runs
unchanged.

* ``GpuSampler``: a daemon thread reads ``nvmlDeviceGetUtilizationRates().gpu`` (the percentage of the last
  sample period in which a kernel ran) and ``nvmlDeviceGetPowerUsage`` every ``interval`` seconds between
  ``start`` and ``stop``. Without ``pynvml`` (the ``nvidia-ml-py`` package) or without a GPU it reports
  ``None``: n/a.
* ``ThreadCpu``: ``utime + stime`` of every thread of the server and of its child processes (a GPU worker
  process would be one), from ``/proc/<pid>/task/<tid>/stat``, with the thread's name from ``.../comm``. Two
  snapshots give each thread's share of a core over the run. Threads that ended in between are missing from
  the per-thread list but still counted in the per-process totals (``/proc/<pid>/stat``).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import attrs

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class GpuSampler:
    def __init__(self, index: int = 0, interval: float = 0.1) -> None:
        self.index, self.interval = index, interval
        self.busy: list[float] = []
        self.watts: list[float] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception as error:  # no package, no driver, no GPU: the figures are n/a
            self.error = f"{type(error).__name__}: {error}"

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def start(self) -> None:
        if not self.available:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        nvml = self._nvml
        while not self._stop.wait(self.interval):
            self.busy.append(nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0)
            self.watts.append(nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0)

    def stop(self) -> dict[str, Any] | None:
        """The summary of the samples since ``start``, or ``None`` when NVML is unavailable."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if not self.available:
            return None
        return {"samples": len(self.busy), "interval_s": self.interval,
                "busy_median": statistics.median(self.busy) if self.busy else None,
                "busy_mean": statistics.fmean(self.busy) if self.busy else None,
                "power_mean_w": statistics.fmean(self.watts) if self.watts else None,
                "busy_samples": [round(b, 2) for b in self.busy]}


def _stat_ticks(stat_text: str) -> tuple[int, int, int]:
    """(ppid, utime + stime, starttime) from a ``stat`` line; ``comm`` may hold spaces, so split after ')'."""
    fields = stat_text.rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19])


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (children, grandchildren...), from the ppid of each /proc entry."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = _stat_ticks((entry / "stat").read_text())[0]
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        found += frontier
    return found


@attrs.frozen
class Snapshot:
    at: float
    threads: dict[tuple[int, int, int], tuple[str, int]]  # (pid, tid, starttime) -> (name, ticks)
    processes: dict[tuple[int, int], int]  # (pid, starttime) -> ticks, dead threads included


class ThreadCpu:
    """CPU time per thread of the process ``pid`` and its descendants between two snapshots."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def snapshot(self) -> Snapshot:
        threads: dict[tuple[int, int, int], tuple[str, int]] = {}
        processes: dict[tuple[int, int], int] = {}
        for pid in descendants(self.pid):
            try:
                _, ticks, started = _stat_ticks(Path(f"/proc/{pid}/stat").read_text())
                processes[(pid, started)] = ticks
                for task in Path(f"/proc/{pid}/task").iterdir():
                    _, thread_ticks, thread_started = _stat_ticks((task / "stat").read_text())
                    name = (task / "comm").read_text().strip()
                    threads[(pid, int(task.name), thread_started)] = (name, thread_ticks)
            except (OSError, IndexError, ValueError):  # the process or thread ended meanwhile
                continue
        return Snapshot(time.perf_counter(), threads, processes)

    def delta(self, before: Snapshot, after: Snapshot) -> dict[str, Any]:
        """Cores used (CPU seconds per wall second) in total and per thread, busiest first. A thread is named
        ``comm`` (its OS name), ``[main]`` marks a process's first thread, ``child <pid>:`` a descendant's."""
        wall = after.at - before.at
        if wall <= 0:
            return {"wall_s": wall, "total_cores": None, "threads": []}
        total = sum(ticks - before.processes.get(key, 0) for key, ticks in after.processes.items())
        threads: list[dict[str, Any]] = []
        for (pid, tid, started), (name, ticks) in after.threads.items():
            used = (ticks - before.threads.get((pid, tid, started), (name, 0))[1]) / CLOCK_TICKS / wall
            label = ("" if pid == self.pid else f"child {pid}:") + name + (" [main]" if tid == pid else "")
            threads.append({"tid": tid, "name": label, "cores": round(used, 4)})
        threads.sort(key=lambda t: -float(t["cores"]))
        return {"wall_s": round(wall, 3), "total_cores": round(total / CLOCK_TICKS / wall, 4), "threads": threads}


def top_threads(server_cpu: dict[str, Any] | None, count: int = 3, floor: float = 0.01) -> str:
    """``name 0.71, name 0.40, ...``: the busiest ``count`` threads above ``floor`` cores, for tables."""
    if not server_cpu or server_cpu.get("total_cores") is None:
        return "n/a"
    busy = [t for t in server_cpu["threads"][:count] if t["cores"] >= floor]
    return ", ".join(f"{t['name']} {t['cores']:.2f}" for t in busy) or "idle"


def listening_pid(port: int) -> int | None:
    """The process with a listening TCP socket on ``port`` (IPv4 or IPv6), found through /proc/net/tcp* and
    each process's file descriptors; ``None`` if none is visible to this user."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return int(entry.name)
        except OSError:
            continue
    return None
