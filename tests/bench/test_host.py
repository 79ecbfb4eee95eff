"""How busy the host was during a benchmark, and the line the benchmarks print when it was."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierserve.bench import host
from tierserve.cli import main

TICKS = 100.0


def cpus(*rows: tuple[int, int, int, int]) -> dict[int, list[int]]:
    """One row per CPU: (busy user ticks, idle, iowait, steal) as /proc/stat fields."""
    return {i: [user, 0, 0, idle, iowait, 0, 0, steal] for i, (user, idle, iowait, steal) in enumerate(rows)}


def test_other_processes_time_is_the_busy_time_this_process_did_not_use() -> None:
    before = host.Snapshot(cpus((0, 0, 0, 0), (0, 0, 0, 0)), own_cpu_s=1.0, load_avg_1m=0.2)
    # 2 CPUs x 100 ticks: 120 busy (50 of them ours), 60 idle, 10 iowait, 10 steal.
    after = host.Snapshot(cpus((80, 10, 5, 5), (40, 50, 5, 5)), own_cpu_s=1.5, load_avg_1m=3.0)
    load = host.host_load(before, after, num_cpus=2, ticks_per_s=TICKS)
    assert load.others_cpu_pct == pytest.approx(100 * (120 - 50) / 200)
    assert load.steal_pct == pytest.approx(100 * 10 / 200)
    assert load.load_avg_1m_at_start == 0.2  # what was there before the run, not the run itself
    warning = load.warning()
    assert warning is not None and warning.startswith("host busy:")
    assert "other processes used 35 % of the CPUs" in warning and "5 % CPU steal" in warning
    assert "load average" not in warning


def test_a_quiet_host_gets_no_warning_and_a_loaded_one_names_its_load() -> None:
    quiet = host.HostLoad(num_cpus=4, load_avg_1m_at_start=0.4, others_cpu_pct=3.0, steal_pct=0.0)
    assert quiet.warning() is None and quiet.as_dict()["busy"] is False
    loaded = host.HostLoad(num_cpus=2, load_avg_1m_at_start=5.0, others_cpu_pct=None, steal_pct=None)
    assert "load average 5.0 on 2 CPUs before the run" in (loaded.warning() or "")
    assert loaded.as_dict()["busy"] is True
    unknown = host.HostLoad(num_cpus=2, load_avg_1m_at_start=None, others_cpu_pct=None, steal_pct=None)
    assert unknown.warning() is None  # where the platform does not say, nothing is claimed


def test_the_monitor_reads_this_machine() -> None:
    load = host.HostMonitor().finish()
    assert load.num_cpus >= 1
    if os.path.exists("/proc/stat"):
        assert load.others_cpu_pct is None or 0.0 <= load.others_cpu_pct <= 100.0
        assert load.steal_pct is None or 0.0 <= load.steal_pct <= 100.0


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_cpu_of_a_child_still_running_is_this_runs_own_not_other_processes() -> None:
    """A benchmark's servers and load generators still run when it measures the host: their
    CPU is the run's own (it was counted as other processes', and called the host busy)."""
    import subprocess
    import sys

    burn = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
    before = host.snapshot()
    child = subprocess.Popen(
        [sys.executable, "-c", burn + "print('burnt', flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "burnt\n"
        after = host.snapshot()  # the child has used 0.5 s of CPU and still runs
    finally:
        child.communicate()
    assert after.own_cpu_s - before.own_cpu_s >= 0.45


def test_descendants_are_found_through_every_generation(tmp_path: Path) -> None:
    def proc(pid: int, ppid: int, name: str, ticks: tuple[int, int, int, int]) -> None:
        (tmp_path / str(pid)).mkdir()
        times = " ".join(map(str, ticks))
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) S {ppid} 0 0 0 0 0 0 0 0 0 {times} 20\n")

    tick = float(os.sysconf("SC_CLK_TCK"))
    proc(10, 1, "bench", (500, 500, 0, 0))
    proc(11, 10, "serve) S 99 (odd", (10, 5, 3, 2))  # a name that holds ") S 99 ("
    proc(12, 11, "engine", (100, 0, 0, 0))
    proc(13, 1, "other", (900, 0, 0, 0))
    (tmp_path / "self").mkdir()
    assert host.live_descendants_cpu_s(tmp_path, root=10) == pytest.approx(120 / tick)
    assert host.live_descendants_cpu_s(tmp_path / "missing", root=10) == 0.0


def fake_host(monkeypatch: pytest.MonkeyPatch, load_avg: float) -> None:
    idle = cpus((0, 0, 0, 0))
    snaps: Iterator[host.Snapshot] = iter([host.Snapshot(idle, 0.0, load_avg), host.Snapshot(idle, 0.0, 0.0)])
    monkeypatch.setattr(host, "snapshot", lambda: next(snaps))


OVERHEAD = ["bench", "overhead", "--running", "4", "--waiting", "4", "--passes", "2", "--policies", "fcfs"]


def test_bench_overhead_names_a_busy_hosts_load(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    busy_load = 4.0 * (os.cpu_count() or 1)
    fake_host(monkeypatch, busy_load)
    assert main(OVERHEAD) == 0
    out = capsys.readouterr().out
    assert f"host busy: load average {busy_load:.1f}" in out
    fake_host(monkeypatch, 0.0)
    assert main(OVERHEAD) == 0
    assert "host busy" not in capsys.readouterr().out
    fake_host(monkeypatch, busy_load)
    assert main([*OVERHEAD, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["host"]["busy"] is True
