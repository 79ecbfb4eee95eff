"""`tierserve bench gateway --json`, on the smallest bounded fleet: the keys the issue names."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tierserve.cli import main
from tierserve.tiers import Tier


def test_bench_gateway_prints_overhead_and_per_tier_maps_for_both_arms(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierserve.bench import host

    # A host with a load average of 4 per CPU before the run: the result must name it.
    busy = 4.0 * (os.cpu_count() or 1)
    snaps = iter([host.Snapshot(None, 0.0, busy), host.Snapshot(None, 0.0, 0.0)])
    monkeypatch.setattr(host, "snapshot", lambda: next(snaps))
    argv = ["bench", "gateway", "--json", "--streams", "4", "--replicas", "1", "--max-seqs", "2"]
    argv += ["--duration", "1.5", "--max-tokens", "4", "--overhead-seconds", "1", "--overhead-tokens", "4"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert isinstance(result["overhead_p50_ms"], float) and isinstance(result["overhead_p99_ms"], float)
    assert result["gateway_queued"] >= 0 and result["gateway_queue_wait_s"] >= 0
    assert result["overhead_requests"] >= 1
    # The gateway's own time, from its histogram: every stream through it was observed.
    assert 0 < result["gateway_added_p50_ms"] <= result["gateway_added_p99_ms"]
    assert 0.0 <= result["gateway_added_within_2ms"] <= 1.0
    assert result["upstream_policy"] == "fcfs"
    assert result["capacity_rps"] > 0
    assert result["commit"]  # which code gave the figures
    settings = result["settings"]  # what the run was asked for
    assert (settings["streams"], settings["replicas"], settings["max_seqs"]) == (4, 1, 2)
    assert settings["load"] == 1.2 and settings["overhead_tokens"] == 4 and "func" not in settings
    # offered = 1.2 x capacity, with a floor of 0.5 req/s for a very slow host
    assert result["offered_rps"] == pytest.approx(max(0.5, 1.2 * result["capacity_rps"]), abs=0.01)
    for arm in ("flow_control", "least_loaded"):
        tiers = result[arm]
        assert set(tiers) == {"P0", "P1", "P2"}
        assert sum(t["sent"] for t in tiers.values()) >= 1
        for t in tiers.values():
            assert t["slo_attainment"] is None or 0.0 <= t["slo_attainment"] <= 1.0
            assert t["goodput_rps"] >= 0.0
    assert result["host"]["busy"] is True and result["host"]["load_avg_1m_at_start"] == busy
    assert result["host_warning"].startswith(f"host busy: load average {busy:.1f}")


def _no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make starting the fleet fail the test (main() reports it as a failure, exit 1)."""
    from tierserve.bench import gateway_bench

    def measure(args: object) -> dict[str, object]:
        raise AssertionError("the run started")

    monkeypatch.setattr(gateway_bench, "measure", measure)


@pytest.mark.parametrize(
    "bad",
    [
        ["--replicas", "0"],
        ["--streams", "0"],
        ["--max-seqs", "0"],
        ["--load", "nan"],
        ["--duration", "-1"],
        ["--overhead-seconds", "inf"],
        ["--max-tokens", "0"],
    ],
)
def test_arguments_are_bounded_before_any_process_starts(
    bad: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # They started the fleet, then failed with "no stream completed" or ran an empty arm.
    _no_run(monkeypatch)
    with pytest.raises(SystemExit) as exited:
        main(["bench", "gateway", *bad])
    assert exited.value.code == 2 and bad[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        (["--replicas", "5000"], "--replicas <= 16"),
        (["--streams", "1000000"], "--streams <= 2000"),
        (["--duration", "1e12"], "--duration <= 3600"),
        (["--load", "1e9"], "--load <= 100"),
        (["--max-seqs", "100000"], "--max-seqs <= 1024"),
        # Past the model's context: it failed only after the overhead run, 35 s in.
        (["--overhead-tokens", "200000"], "context is"),
        (["--max-tokens", "200000"], "context is"),
    ],
)
def test_arguments_past_the_benchs_bounds_fail_before_any_process_starts(
    bad: list[str], said: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_run(monkeypatch)
    assert main(["bench", "gateway", *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierserve bench gateway: ") and said in err and err.count("\n") == 1


def test_an_out_path_that_cannot_be_written_fails_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_run(monkeypatch)
    assert main(["bench", "gateway", "--out", "/proc/no/such/result.json"]) == 2


def test_the_capacity_probe_counts_every_completion(monkeypatch: pytest.MonkeyPatch) -> None:
    # Concurrent clients: a `done += await ...` lost the completions counted meanwhile.
    import asyncio
    import time

    from tierserve.bench import gateway_bench

    calls = 0

    async def fake_shot(client: object, url: str, tier: object, max_tokens: int, i: int) -> object:
        nonlocal calls
        await asyncio.sleep(0.005)
        calls += 1
        return gateway_bench.Shot(tier, True, 0.001)  # type: ignore[arg-type]

    monkeypatch.setattr(gateway_bench, "_shot", fake_shot)
    start = time.perf_counter()
    rate = asyncio.run(gateway_bench._capacity("http://127.0.0.1:1", 8, 0.3, 1))
    elapsed = time.perf_counter() - start
    assert calls > 8
    assert rate * elapsed >= 0.9 * calls


def test_the_overhead_run_reports_what_waited_in_the_gateways_queue() -> None:
    from tierserve.bench.gateway_bench import _queued

    text = "\n".join(
        [
            "# TYPE tierserve_gateway_queue_wait_seconds histogram",
            'tierserve_gateway_queue_wait_seconds_count{priority="P0"} 2.0',
            'tierserve_gateway_queue_wait_seconds_sum{priority="P0"} 0.25',
            'tierserve_gateway_queue_wait_seconds_count{priority="P1"} 8.0',
            'tierserve_gateway_queue_wait_seconds_sum{priority="P1"} 1.5',
            'tierserve_gateway_queue_depth{priority="P1"} 3.0',
        ]
    )
    assert _queued(text) == {"gateway_queued": 10.0, "gateway_queue_wait_s": 1.75}


def test_the_gateways_added_latency_is_read_from_its_histogram_as_prometheus_would() -> None:
    from tierserve.bench.gateway_bench import ADDED, _bucket_counts

    def scrape(counts: dict[str, float]) -> str:
        lines = [f"# TYPE {ADDED} histogram"]
        lines += [f'{ADDED}_bucket{{le="{le}"}} {n}' for le, n in counts.items()]
        return "\n".join([*lines, f"{ADDED}_count {counts['+Inf']}", f"{ADDED}_sum 1.0", ""])

    before = _bucket_counts(scrape({"0.001": 5, "0.002": 5, "0.01": 5, "+Inf": 5}), ADDED)
    after = _bucket_counts(scrape({"0.001": 55, "0.002": 95, "0.01": 104, "+Inf": 105}), ADDED)
    run = after - before  # 50 under 1 ms, 40 in 1-2 ms, 9 in 2-10 ms, 1 beyond
    assert run.share_within(0.002) == pytest.approx(0.9)
    assert run.quantile(0.5) == pytest.approx(0.001)  # rank 50: the top of the first bucket
    assert run.quantile(0.7) == pytest.approx(0.001 + 0.001 * 20 / 40)
    assert run.quantile(0.995) == pytest.approx(0.01)  # past the last finite bound


def test_sigterm_inside_a_local_fleet_stops_its_processes(tmp_path: Path) -> None:
    """`timeout` and CI runners stop a job with SIGTERM: the replicas and gateways the bench
    started must go with it (they were left running, holding their ports)."""
    script = (
        "import sys, time\n"
        "from tierserve.gateway.local_fleet import local_fleet\n"
        "with local_fleet(1, '', {}) as urls:\n"
        "    print(urls['u0'], flush=True)\n"
        "    time.sleep(120)\n"
    )
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert bench.stdout is not None
    url = bench.stdout.readline().strip()
    port = url.rpartition(":")[2]
    try:
        assert httpx.get(url + "/ready", timeout=5).status_code == 200
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/ready", timeout=5)
    finally:
        bench.kill()
        bench.wait()
        for pid in _serving_on(port):  # left behind (before the fix): stop them, by pid
            os.kill(pid, signal.SIGKILL)


def _serving_on(port: str) -> list[int]:
    """The pids of `serve --port PORT` processes, from /proc."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in args and b"--port" in args and port.encode() in args:
            pids.append(int(cmdline.parent.name))
    return pids


def test_each_tier_counts_what_failed_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica or gateway that refuses: its refusals were counted nowhere, only as a lower
    SLO attainment; sent = ok + failed, by reason."""
    import asyncio

    from tierserve.bench import gateway_bench

    async def fake_shot(client: object, url: str, tier: Tier, max_tokens: int, i: int) -> object:
        if i % 3 == 0:
            return gateway_bench.Shot(tier, False, None, "503")
        return gateway_bench.Shot(tier, True, 0.001)

    monkeypatch.setattr(gateway_bench, "_shot", fake_shot)
    result = asyncio.run(gateway_bench._open_loop("http://127.0.0.1:1", 400.0, 0.1, 1, seed=1))
    sent = sum(t["sent"] for t in result.values())
    assert sent > 3
    for t in result.values():
        assert t["sent"] == t["ok"] + sum(t["failed"].values())
        assert set(t["failed"]) <= {"503"}
    assert sum(t["failed"].get("503", 0) for t in result.values()) == len(range(0, sent, 3))


def test_probes_whose_every_request_fails_say_what_the_requests_got(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--max-tokens 100000000`: every probe request got a 400, the capacity was 0, the bench
    offered 0.5 requests/s anyway and exited 0; `--overhead-tokens` past the context blamed
    the clients' timing ("raise --overhead-seconds")."""
    import asyncio

    from tierserve.bench import gateway_bench

    async def refused(client: object, url: str, tier: Tier, max_tokens: int, i: int) -> object:
        await asyncio.sleep(0.001)
        return gateway_bench.Shot(tier, False, None, "400")

    monkeypatch.setattr(gateway_bench, "_shot", refused)
    monkeypatch.setattr(gateway_bench, "OVERHEAD_WARMUP_S", 0.0)
    import aiohttp  # noqa: F401  (imported now: the probes' 0.1 s are theirs)

    with pytest.raises(RuntimeError, match=r"completed no request in 0.1 s \(answers 400: \d+\); a 400 may"):
        asyncio.run(gateway_bench._capacity("http://127.0.0.1:1", 2, 0.1, 10**8))
    with pytest.raises(RuntimeError, match=r"every request of the overhead run failed \(answers 400: \d+\)"):
        asyncio.run(gateway_bench._streams("http://127.0.0.1:1", 2, 1.2, 10**8, seed=0))  # starts within 1 s


def test_a_stream_is_bounded_by_its_silence_not_by_a_total_that_cut_long_answers() -> None:
    """A 30 s cap on the whole stream made a request whose first token met its target a
    miss once its answer took longer: P2's 60 s target could never be met past 30 s."""
    import asyncio

    from tierserve.bench import gateway_bench

    async def timeout() -> object:
        async with gateway_bench._session(1) as session:
            return session.timeout

    from tierserve.gateway.config import DEFAULT_MAX_WAIT_S

    t = asyncio.run(timeout())
    # Silence is allowed past the longest a request may wait in the gateway's queue, which
    # answers nothing meanwhile (30 s cut a P2 request whose first token came at 35 s).
    assert t.sock_read == gateway_bench.REQUEST_TIMEOUT_S > max(DEFAULT_MAX_WAIT_S.values())
    assert t.total == gateway_bench.STREAM_LIMIT_S > gateway_bench.REQUEST_TIMEOUT_S


def test_an_overload_arm_past_its_request_cap_is_refused_before_it_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--load x the probed capacity x --duration is only known once the capacity is probed:
    200,000 requests a second for a second made ~200k requests and 1.6 GB."""
    from contextlib import contextmanager

    from tierserve.bench import gateway_bench
    from tierserve.gateway import local_fleet

    @contextmanager
    def fleet(num: int, engine: str, arms: dict[str, str], policy: str = "hybrid") -> Any:
        yield {name: "http://127.0.0.1:1" for name in ("u0", "gw", *arms)}

    async def overhead(*args: object) -> dict[str, float]:
        return {}

    async def capacity(*args: object) -> float:
        return 1_000.0

    async def open_loop(*args: object) -> dict[str, object]:
        raise AssertionError("the overload arm was sent")

    monkeypatch.setattr(local_fleet, "local_fleet", fleet)
    monkeypatch.setattr(gateway_bench, "_overhead", overhead)
    monkeypatch.setattr(gateway_bench, "_capacity", capacity)
    monkeypatch.setattr(gateway_bench, "_open_loop", open_loop)
    args = argparse.Namespace(
        streams=4,
        overhead_seconds=1.0,
        overhead_tokens=4,
        seed=0,
        max_seqs=2,
        replicas=1,
        duration=100.0,
        load=1.0,
        max_tokens=4,
        upstream_policy="fcfs",
    )
    with pytest.raises(ValueError, match=r"100,000 requests an arm; at most 50,000"):
        gateway_bench.measure(args)
