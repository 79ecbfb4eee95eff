"""`tierserve bench serve`: seeded workload, the overhead arithmetic, and a tiny real run."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tierserve.bench import host, serve_bench
from tierserve.bench.serve_bench import summarize
from tierserve.server.loadgen import CUT_OFF, Outcome, make_specs


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_bench.register(parser.add_subparsers())
    return parser.parse_args(argv)


def test_workload_is_seeded_and_follows_the_tier_mix() -> None:
    a = make_specs(400, 3, [5, 60, 30, 5], (64, 128), (16, 32))
    assert a == make_specs(400, 3, [5, 60, 30, 5], (64, 128), (16, 32))
    assert a != make_specs(400, 4, [5, 60, 30, 5], (64, 128), (16, 32))
    share = sum(s.tier == "P1" for s in a) / len(a)
    assert 0.5 < share < 0.7
    assert all(16 <= s.max_tokens <= 32 for s in a)
    assert not any(s.tier == "P0" for s in make_specs(100, 0, [0, 1, 1, 1], (8, 8), (1, 1)))


def test_overhead_is_http_ttft_minus_engine_ttft_split_into_request_and_response_paths() -> None:
    outcomes = [
        Outcome("P0", "ok", ttft_s=0.150, e2e_s=1.0, num_output_tokens=10, request_id="a"),
        Outcome("P1", "ok", ttft_s=0.300, e2e_s=1.0, num_output_tokens=10, request_id="b"),
        Outcome("P1", "503:queue_full"),
    ]
    # engine: id -> (TTFT in the engine, first token on the event loop at); http: (body in at, chunk out at)
    engine = {"a": (0.100, 10.100), "b": (0.250, 20.250)}
    http = {"a": (9.998, 10.103), "b": (19.999, 20.252)}
    r = summarize(outcomes, engine, http, wall_s=2.0, config={})
    assert r.num_ok == 2 and r.rejections == {"503:queue_full": 1}
    assert r.request_path_p50_ms == pytest.approx(1.5) and r.response_path_p50_ms == pytest.approx(2.5)
    assert r.api_overhead_p50_ms == pytest.approx(4.0) and r.api_overhead_samples == 2
    assert r.client_overhead_p50_ms == pytest.approx(50.0)
    assert r.tiers["P1"]["rejected"] == 1 and r.tiers["P0"]["engine_ttft_p50_ms"] == pytest.approx(100.0)
    assert r.output_tokens_per_s == 10.0


def test_warmup_requests_are_left_out_of_the_ttft_and_overhead_percentiles() -> None:
    outcomes = [
        Outcome("P0", "ok", ttft_s=5.0, e2e_s=6.0, num_output_tokens=1, request_id="burst", index=0),
        Outcome("P0", "ok", ttft_s=0.1, e2e_s=1.0, num_output_tokens=1, request_id="steady", index=1),
    ]
    engine = {"burst": (4.9, 104.9), "steady": (0.09, 200.09)}
    http = {"burst": (99.99, 104.91), "steady": (199.999, 200.1)}
    r = summarize(outcomes, engine, http, wall_s=1.0, config={}, warmup=1)
    p0 = r.tiers["P0"]
    assert p0["sent"] == 2 and p0["ttft_p95_ms"] == pytest.approx(100.0)
    assert p0["engine_ttft_p95_ms"] == pytest.approx(90.0)
    assert r.api_overhead_samples == 1 and r.warmup_requests == 1 and r.num_ok == 2
    # steady: body in at 199.999, the step returned 0.09 s after arrival at 200.09, chunk out at 200.1
    assert r.api_overhead_p99_ms == pytest.approx(11.0) and r.response_path_p50_ms == pytest.approx(10.0)
    assert r.client_overhead_p50_ms == pytest.approx(10.0)
    # the burst's request (body in at 99.99, arrival at 100.0, chunk out 10 ms after the step)
    assert r.api_overhead_all_p99_ms == pytest.approx(20.0, abs=0.2)
    everything = summarize(outcomes, engine, http, wall_s=1.0, config={})
    assert everything.tiers["P0"]["ttft_p95_ms"] > 4000 and everything.api_overhead_samples == 2


def test_each_tier_says_how_many_requests_its_percentiles_are_over(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A P95 of 2 requests looked like one of 200: the table gave no count to tell them apart.
    outcomes = [
        Outcome("P1", "ok", ttft_s=0.5, num_output_tokens=1, request_id="burst", index=0),
        Outcome("P1", "ok", ttft_s=0.1, num_output_tokens=1, request_id="a", index=1),
        Outcome("P1", "429:rate_limit_exceeded", index=2),
        Outcome("P1", "ok", ttft_s=0.2, num_output_tokens=1, request_id="b", index=3),
    ]
    engine = {rid: (0.05, 10.0) for rid in ("burst", "a", "b")}
    http: dict[str, tuple[float, float | None]] = {rid: (9.94, 10.001) for rid in ("burst", "a", "b")}
    config = {"model": "m", "tp": 1, "gpu": "g", "policy": "p", "concurrency": 1, "requests": 10}
    r = summarize(outcomes, engine, http, wall_s=1.0, config=config, warmup=1)
    p1 = r.tiers["P1"]
    assert (p1["sent"], p1["ok"], p1["rejected"], p1["ttft_samples"]) == (4, 3, 1, 2)
    assert r.tiers["P0"]["ttft_samples"] == 0
    serve_bench.print_table(r)
    out = capsys.readouterr().out
    header, row = out.splitlines()[1], out.splitlines()[3]  # P0, then P1
    assert header.split()[:5] == ["tier", "sent", "ok", "refused", "timed"]
    assert row.split()[:5] == ["P1", "4", "3", "1", "2"]
    assert "a P99 over 2 requests is about their slowest" in out
    assert "6 of the 10 requests not sent: --duration-s ran out" in out


def test_the_in_process_ttft_and_the_overhead_are_over_the_timed_requests_and_a_cut_off_is_no_refusal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A request cut off by --duration-s had its first token in the engine but none at the
    client: its in-process TTFT went into the "engine" column and its overhead into the API
    overhead, beside HTTP columns without it (engine P95 above the HTTP P95 of the same
    tier), and the table counted it as refused."""
    outcomes = [
        Outcome("P2", "ok", ttft_s=0.100, num_output_tokens=1, request_id="a", index=0),
        Outcome("P2", CUT_OFF, request_id="late", index=1),
    ]
    engine = {"a": (0.080, 10.080), "late": (0.500, 20.500)}
    http: dict[str, tuple[float, float | None]] = {"a": (9.999, 10.082), "late": (19.999, 20.502)}
    config = {"model": "m", "tp": 1, "gpu": "g", "policy": "p", "concurrency": 1, "requests": 2}
    r = summarize(outcomes, engine, http, wall_s=1.0, config=config)
    p2 = r.tiers["P2"]
    assert p2["engine_ttft_p95_ms"] == pytest.approx(80.0) and p2["ttft_samples"] == 1
    assert r.api_overhead_samples == 1 and r.api_overhead_p99_ms == pytest.approx(3.0)
    assert (p2["rejected"], p2["cut_off"], r.rejections, r.num_cut_off) == (0, 1, {}, 1)
    serve_bench.print_table(r)
    out = capsys.readouterr().out
    assert out.splitlines()[4].split()[:5] == ["P2", "2", "1", "0", "1"]
    assert "1 requests still running when --duration-s ran out (cut off, not refused)" in out


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2+ CPUs"
)
def test_the_load_generator_gets_a_cpu_the_server_keeps_off() -> None:
    before = os.sched_getaffinity(0)
    with serve_bench._cpu_for_the_load_generator() as spare:
        assert spare is not None and len(spare) == 1 and spare <= before
        assert os.sched_getaffinity(0) == before - spare
    assert os.sched_getaffinity(0) == before


def test_arguments_are_bounded() -> None:
    assert serve_bench.run(_parse(["serve", "--requests", "0"])) == 2
    assert serve_bench.run(_parse(["serve", "--tier-mix", "1/2/3"])) == 2
    assert serve_bench.run(_parse(["serve", "--requests", "10", "--warmup", "10"])) == 2
    with pytest.raises(SystemExit):
        _parse(["serve", "--max-tokens", "9-3"])
    for bad in (["--duration-s", "inf"], ["--duration-s", "nan"], ["--prompt-tokens", "5-"]):
        with pytest.raises(SystemExit):  # inf ended in an OverflowError; "5-" ran as 5-5
            _parse(["serve", *bad])


def test_a_small_run_against_the_sim_server_reports_every_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "serve.json"
    args = _parse(
        [
            "serve",
            "--requests",
            "16",
            "--concurrency",
            "4",
            "--prompt-tokens",
            "16-48",
            "--max-tokens",
            "2-6",
            "--duration-s",
            "60",
            "--model",
            "llama-3.1-8b",
            "--tp",
            "1",
            "--flood-clients",
            "1",
            "--out",
            str(out),
            "--json",
        ]
    )
    assert serve_bench.run(args) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert printed == json.loads(out.read_text())
    # Each run says on stderr that it starts: the two take minutes at the defaults.
    said = [line for line in captured.err.splitlines() if line.startswith("[bench serve] run")]
    assert [line.split(":")[0] for line in said] == ["[bench serve] run 1 of 2", "[bench serve] run 2 of 2"]
    assert printed["num_sent"] == 16 and printed["num_ok"] == 16 and printed["rejections"] == {}
    assert printed["warmup_requests"] == 4 and printed["api_overhead_samples"] == 16 - 4
    for key in (
        "api_overhead_p50_ms",
        "api_overhead_p99_ms",
        "api_overhead_all_p99_ms",
        "client_overhead_p99_ms",
        "request_path_p50_ms",
        "response_path_p50_ms",
    ):
        assert printed[key] is not None and printed[key] > 0, key
    assert printed["api_overhead_p50_ms"] <= printed["client_overhead_p50_ms"]
    if sys.platform == "linux":  # the host's steal time over the run, from /proc/stat
        assert 0.0 <= printed["server_cpu_steal_pct"] <= 100.0
        assert printed["host"]["num_cpus"] >= 1 and 0.0 <= printed["host"]["others_cpu_pct"] <= 100.0
    assert sum(t["sent"] for t in printed["tiers"].values()) == 16
    assert sum(t["ttft_samples"] for t in printed["tiers"].values()) == 16 - 4
    assert printed["output_tokens_per_s"] > 0
    # The same requests again beside a flood of large bodies, every one of them refused.
    assert printed["flood"] is None and printed["commit"]
    judged = printed["flood_p0"]  # the verdict's figures, for a reader to check
    assert set(judged) == {"ttft_p95_change_pct", "server_added_change_pct", "samples"}
    flooded = printed["with_flood"]
    assert flooded["num_sent"] == 16 and flooded["api_overhead_p99_ms"] is not None
    flood = flooded["flood"]
    assert flood["clients"] == 1 and flood["num_sent"] > 0 and set(flood["statuses"]) == {"400"}


def test_the_flood_sends_valid_and_invalid_bodies_of_about_one_mib() -> None:
    from tierserve.bench.flood import BODY_BYTES, bodies

    valid, invalid = bodies("m")
    assert BODY_BYTES - 16 <= len(valid) <= BODY_BYTES and len(invalid) == len(valid)
    body = json.loads(valid)
    assert body["model"] == "m" and len(body["prompt"]) > 100_000
    with pytest.raises(json.JSONDecodeError):
        json.loads(invalid)


def test_the_load_generator_times_the_first_chunk_that_carries_text() -> None:
    from tierserve.server.loadgen import _has_text

    role = 'data: {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}'
    assert not _has_text(role)  # a chat stream opens with it when the engine accepts the request
    assert _has_text('data: {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}]}')
    assert _has_text('data: {"id": "c", "choices": [{"index": 0, "text": " lorem"}]}')
    assert not _has_text('data: {"id": "c", "choices": [{"index": 0, "text": ""}]}')
    assert not _has_text('data: {"id": "c", "choices": [], "usage": {"completion_tokens": 3}}')


def test_requests_still_running_when_the_time_runs_out_are_counted() -> None:
    """Streams cut off at `duration_s` were dropped: the report said 0 requests sent while
    the server-side figures held them."""
    import asyncio

    from aiohttp import web

    from tierserve.server.loadgen import drive

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"id": "cmpl-1", "choices": [{"index": 0, "text": "hi"}]}\n\n')
        await asyncio.sleep(3600)  # never ends: the client's time runs out first
        return response

    async def scenario() -> list[Outcome]:
        app = web.Application()
        app.router.add_post("/v1/completions", endless)
        runner = web.AppRunner(app, shutdown_timeout=0.1)  # the endless handler is not waited for
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            specs = make_specs(5, 0, [1, 1, 1, 1], (4, 4), (8, 8))
            return await drive(f"http://127.0.0.1:{port}", "m", specs, 2, 0.5)
        finally:
            await runner.cleanup()

    outcomes = asyncio.run(scenario())
    assert sorted(o.index for o in outcomes) == [0, 1]  # the two in flight; the rest never sent
    for o in outcomes:
        assert o.status == "cut_off_at_duration_s" and o.request_id == "cmpl-1" and o.ttft_s is not None


STAT = """cpu  10 0 10 80 0 0 0 0 0 0
cpu0 {0} 0 {1} {2} 0 0 0 {3} 0 0
cpu1 100 0 0 900 0 0 0 0 0 0
intr 12345
"""


def test_steal_is_the_stolen_share_of_the_server_cpus_time() -> None:
    before = host.cpu_times(STAT.format(100, 50, 800, 50))
    after = host.cpu_times(STAT.format(150, 60, 970, 70))
    assert sorted(before) == [0, 1] and before[0][:4] == [100, 0, 50, 800]
    # CPU 0: 50 user + 10 system + 170 idle + 20 stolen = 250 ticks, 20 of them stolen.
    assert host.steal_pct(before, after, {0}) == pytest.approx(8.0)
    # CPU 1's counters did not move: alone it has no time to share out; with CPU 0, only
    # CPU 0's ticks count.
    assert host.steal_pct(before, before, {1}) is None
    assert host.steal_pct(before, after, {0, 1}) == pytest.approx(8.0)
    assert host.steal_pct(before, after, {2}) is None  # a CPU the counters do not list


def test_the_load_generator_draws_its_progress_where_asked() -> None:
    import asyncio
    import io

    from tests.server.helpers import MODEL, live_server, make_state
    from tierserve.server.loadgen import drive

    specs = make_specs(5, 0, [1, 1, 1, 1], (4, 8), (1, 3))
    bar = io.StringIO()
    with live_server(make_state()) as srv:
        quiet = asyncio.run(drive(srv.url, MODEL, specs, 2, 30.0))
        shown = asyncio.run(drive(srv.url, MODEL, specs, 2, 30.0, progress=bar))
    assert [o.status for o in quiet] == [o.status for o in shown] == ["ok"] * 5
    assert "bench serve" in bar.getvalue() and "5/5" in bar.getvalue()  # the bar's last state


def test_a_config_whose_tenants_need_keys_is_loaded_with_the_key_from_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a config with keys every request was a 401: the clients could send none. The
    key comes from the environment, and is written nowhere."""
    config = tmp_path / "keys.toml"
    config.write_text('[tenants.acme]\napi_keys = ["sk-bench-secret"]\nmax_tier = "P0"\n')
    monkeypatch.setenv("TIERSERVE_TEST_BENCH_KEY", "sk-bench-secret")
    argv = ["serve", "--requests", "8", "--concurrency", "2", "--prompt-tokens", "16-32"]
    argv += ["--max-tokens", "2-4", "--duration-s", "60", "--model", "llama-3.1-8b", "--tp", "1"]
    argv += ["--flood-clients", "0", "--config", str(config), "--json"]
    keyed = _parse([*argv, "--api-key-env", "TIERSERVE_TEST_BENCH_KEY", "--out", str(tmp_path / "a.json")])
    assert serve_bench.run(keyed) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed)["num_ok"] == 8 and "sk-bench-secret" not in printed
    assert "sk-bench-secret" not in (tmp_path / "a.json").read_text()
    without = _parse([*argv, "--out", str(tmp_path / "b.json")])  # ran, every request a 401
    with pytest.raises(ValueError, match=r"its tenants need an API key; .* --api-key-env NAME"):
        serve_bench.run(without)
    assert not (tmp_path / "b.json").exists()
    with pytest.raises(ValueError, match="--api-key-env TIERSERVE_TEST_UNSET_KEY: that environment"):
        serve_bench.run(_parse([*argv, "--api-key-env", "TIERSERVE_TEST_UNSET_KEY"]))


def test_the_flood_verdict_reads_what_the_server_added_request_by_request() -> None:
    """The P0 requests of the two runs land in different simulated steps: the client's P95
    moved -13 to +18 % between identical runs, the engine's P95 with it, and the verdict
    flipped. What the server adds to each request's engine TTFT is what a flood of bodies
    can touch (a difference of two P95s, taken over different requests, was not it)."""
    from types import SimpleNamespace

    def run(http: float | None, added: float | None, samples: int) -> Any:
        p0 = {"ttft_p95_ms": http, "added_p95_ms": added, "added_samples": samples}
        return SimpleNamespace(tiers={"P0": p0})

    judged = serve_bench.flood_p0_change(run(355.0, 2.0, 24), run(420.0, 3.0, 30))
    assert judged is not None
    change, added, samples = judged
    assert change == pytest.approx(100 * 65 / 355) and added == pytest.approx(100 * 1 / 355)
    assert samples == 24
    judged = serve_bench.flood_p0_change(run(300.0, 5.0, 200), run(345.0, 50.0, 200))
    assert judged is not None and judged[1] == pytest.approx(15.0)
    assert serve_bench.flood_p0_change(run(300.0, 5.0, 200), run(None, None, 0)) is None


def test_what_the_server_added_is_taken_request_by_request() -> None:
    from tierserve.bench.serve_bench import _tier_summary

    outcomes = [
        Outcome("P0", "ok", ttft_s=t, request_id=f"r{i}", index=i)
        for i, t in enumerate((0.100, 0.300, 0.500))
    ]
    engine = {"r0": (0.090, 0.0), "r1": (0.100, 0.0), "r2": (0.495, 0.0)}  # added: 10, 200, 5 ms
    row = _tier_summary(outcomes, engine, lambda i: True)
    assert row["added_samples"] == 3 and row["added_p95_ms"] == pytest.approx(181.0, abs=0.5)
