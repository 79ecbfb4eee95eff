"""How busy the host was while a benchmark ran, so that a reader can tell why figures
measured on a shared or overloaded machine differ from a quiet one's.

Three signs, from Linux's /proc/stat and the load average: the load average per CPU when
the run began (work that was there before the benchmark), the share of all CPUs' time that
other processes used during the run (busy time minus this process's and its descendants':
the servers, engines and load generators a benchmark starts are its own work),
and CPU steal (time the hypervisor gave to other virtual machines). Elsewhere each is None.
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LOAD_PER_CPU_HIGH = 0.5  # runnable tasks per CPU before the run: other work competes for the CPUs
OTHERS_CPU_PCT_HIGH = 20.0
STEAL_PCT_HIGH = 5.0
_IDLE, _IOWAIT, _STEAL = 3, 4, 7  # fields of a /proc/stat cpu line: user nice system idle iowait ...


def cpu_times(stat_text: str) -> dict[int, list[int]]:
    """Per-CPU time counters from the text of `/proc/stat` (user, nice, system, idle, iowait,
    irq, softirq, steal, ...), by CPU number."""
    out: dict[int, list[int]] = {}
    for line in stat_text.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            out[int(name[3:])] = [int(f) for f in fields]
    return out


def steal_pct(before: dict[int, list[int]], after: dict[int, list[int]], cpus: set[int]) -> float | None:
    """Percentage of `cpus`' time between two `cpu_times` that was stolen (field 8); None if
    the counters do not say."""
    total = stolen = 0
    for cpu in cpus:
        if cpu not in before or cpu not in after or len(after[cpu]) <= _STEAL:
            return None
        delta = [a - b for a, b in zip(after[cpu][: _STEAL + 1], before[cpu][: _STEAL + 1], strict=True)]
        total += sum(delta)
        stolen += delta[_STEAL]
    return 100.0 * stolen / total if total > 0 else None


def read_cpu_times() -> dict[int, list[int]] | None:
    try:
        return cpu_times(Path("/proc/stat").read_text())
    except OSError:
        return None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The counters `host_load` compares: /proc/stat (ticks), the CPU seconds of this process
    and its descendants (waited-for and still running), and the 1-minute load average."""

    cpu: dict[int, list[int]] | None
    own_cpu_s: float
    load_avg_1m: float | None


def live_descendants_cpu_s(proc: Path = Path("/proc"), root: int | None = None) -> float:
    """CPU seconds of the processes below `root` (default: this one) that are still running,
    with the children each has waited for, from `/proc/PID/stat`; 0.0 where there is no /proc.
    `getrusage(RUSAGE_CHILDREN)` counts a child only once it has ended and been waited for, and
    a benchmark's servers and load generators are still running when it measures: without
    these, their CPU would count as other processes' and call the host busy."""
    parent_of: dict[int, int] = {}
    ticks: dict[int, int] = {}
    try:
        entries = list(proc.iterdir())
    except OSError:
        return 0.0
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            # After the command name (in parentheses, which may hold anything): state ppid ...,
            # utime stime cutime cstime are the 14th to 17th fields of the line.
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            pid = int(entry.name)
            parent_of[pid] = int(fields[1])
            ticks[pid] = sum(int(f) for f in fields[11:15])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile, or not readable
    children: dict[int, list[int]] = {}
    for pid, ppid in parent_of.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, list(children.get(os.getpid() if root is None else root, []))
    while todo:
        pid = todo.pop()
        total += ticks[pid]
        todo += children.get(pid, [])
    return total / float(os.sysconf("SC_CLK_TCK"))


def snapshot() -> Snapshot:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        load: float | None = os.getloadavg()[0]
    except OSError:
        load = None
    own_cpu_s = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    return Snapshot(read_cpu_times(), own_cpu_s + live_descendants_cpu_s(), load)


@dataclass(frozen=True, slots=True)
class HostLoad:
    num_cpus: int
    load_avg_1m_at_start: float | None
    others_cpu_pct: float | None  # of all CPUs' time during the run, used by other processes
    steal_pct: float | None  # of all CPUs' time during the run, given to other virtual machines

    @property
    def load_per_cpu(self) -> float | None:
        return None if self.load_avg_1m_at_start is None else self.load_avg_1m_at_start / self.num_cpus

    def reasons(self) -> list[str]:
        """What made the host busy, one phrase each; empty for a quiet host."""
        out = []
        if self.load_per_cpu is not None and self.load_per_cpu >= LOAD_PER_CPU_HIGH:
            out.append(f"load average {self.load_avg_1m_at_start:.1f} on {self.num_cpus} CPUs before the run")
        if self.others_cpu_pct is not None and self.others_cpu_pct >= OTHERS_CPU_PCT_HIGH:
            out.append(f"other processes used {self.others_cpu_pct:.0f} % of the CPUs during it")
        if self.steal_pct is not None and self.steal_pct >= STEAL_PCT_HIGH:
            out.append(f"{self.steal_pct:.0f} % CPU steal (time given to other virtual machines)")
        return out

    def warning(self) -> str | None:
        """One line naming the host's load when it is high, else None."""
        reasons = self.reasons()
        if not reasons:
            return None
        return (
            f"host busy: {'; '.join(reasons)}. Figures from a busy host are slower and noisier than "
            "from a quiet one; compare runs made on the same, quiet machine"
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "busy": bool(self.reasons())}


def host_load(before: Snapshot, after: Snapshot, num_cpus: int, ticks_per_s: float) -> HostLoad:
    """The host's load between two snapshots of the same machine."""
    others = steal = None
    if before.cpu is not None and after.cpu is not None:
        cpus = set(after.cpu)
        steal = steal_pct(before.cpu, after.cpu, cpus)
        total = busy = 0
        for cpu in cpus & set(before.cpu):
            delta = [a - b for a, b in zip(after.cpu[cpu], before.cpu[cpu], strict=False)]
            total += sum(delta[: _STEAL + 1])
            busy += sum(delta[: _STEAL + 1]) - delta[_IDLE] - delta[_IOWAIT] - delta[_STEAL]
        if total > 0:
            own_ticks = (after.own_cpu_s - before.own_cpu_s) * ticks_per_s
            others = min(100.0, max(0.0, 100.0 * (busy - own_ticks) / total))
    return HostLoad(num_cpus, before.load_avg_1m, others, steal)


class HostMonitor:
    """Takes a snapshot when made; `finish()` says how loaded the host was since."""

    def __init__(self) -> None:
        self._before = snapshot()

    def finish(self) -> HostLoad:
        num_cpus = os.cpu_count() or 1
        return host_load(self._before, snapshot(), num_cpus, float(os.sysconf("SC_CLK_TCK")))
