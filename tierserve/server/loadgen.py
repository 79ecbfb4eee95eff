"""A closed-loop HTTP load generator for the server: seeded, bounded, loopback only.

`drive` runs `concurrency` aiohttp clients that stream completions for a list of `Spec`s
(tier, prompt, max_tokens) until all are sent or `duration_s` passes; each ends in one
`Outcome`. `drive_in_child` runs it in a fresh interpreter, so that the load generator's
own CPU does not compete with the server's threads for the interpreter lock (used by
`tierserve bench serve`), with a progress bar on the terminal drawn by the child (its own
CPU, not the server's). Times are `time.monotonic()` where they cross processes.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

TIERS = ("P0", "P1", "P2", "P3")
CUT_OFF = "cut_off_at_duration_s"  # the status of a request still running when the time ran out
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


@dataclass(frozen=True)
class Spec:
    tier: str
    prompt: str
    max_tokens: int


@dataclass
class Outcome:
    tier: str
    status: str  # "ok", or the refusal, e.g. "503:queue_full", or CUT_OFF
    ttft_s: float | None = None  # client-side: request sent -> first token received
    e2e_s: float | None = None
    num_output_tokens: int = 0
    request_id: str = ""
    first_chunk_at: float | None = None  # time.monotonic() when the first token arrived
    index: int = -1  # position of the request in the send order


def make_specs(
    n: int, seed: int, mix: list[float], prompt_tokens: tuple[int, int], max_tokens: tuple[int, int]
) -> list[Spec]:
    """Tiers by `mix`; prompts of about 4 bytes per simulated token (the sim tokenizer's ratio)."""
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        tier = rng.choices(TIERS, weights=mix)[0]
        num_words = max(1, rng.randint(*prompt_tokens) * 4 // 6)
        prompt = " ".join(rng.choice(WORDS)[:5] for _ in range(num_words))
        specs.append(Spec(tier, prompt, rng.randint(*max_tokens)))
    return specs


async def _one(client: Any, model: str, spec: Spec, out: Outcome) -> None:
    """Send `spec` and fill in `out` as the answer arrives (the caller keeps it: a request cut
    short still counts)."""
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    async with client.post("/v1/completions", json=body, headers={"x-request-tier": spec.tier}) as r:
        if r.status != 200:
            error = json.loads(await r.read()).get("error", {})
            out.status = f"{r.status}:{error.get('code')}"
            return
        async for raw in r.content:
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: {"):
                continue
            if not out.request_id:
                out.request_id = line[len('data: {"id": "') :].split('"', 1)[0]
            if out.ttft_s is None and _has_text(line):  # not a chat stream's opening role chunk
                out.first_chunk_at = time.monotonic()
                out.ttft_s = time.perf_counter() - start
            if '"usage": {' in line:
                out.num_output_tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            elif '"error": {' in line:
                out.status = "aborted"
    out.e2e_s = time.perf_counter() - start


def _has_text(line: str) -> bool:
    """Whether an SSE data line of a completion or chat stream carries generated text."""
    choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
    choice = choices[0]
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


async def drive(
    url: str,
    model: str,
    specs: list[Spec],
    concurrency: int,
    duration_s: float,
    progress: TextIO | None = None,
    api_key: str | None = None,
) -> list[Outcome]:
    """Closed loop: `concurrency` clients send the specs in order until done or `duration_s`
    passes; a progress bar of ended requests is drawn on `progress` where given. `api_key`:
    sent as `Authorization: Bearer` with every request."""
    # aiohttp, not httpx: at 200 streams httpx took 13-24 ms of CPU per stream on a 2-core
    # host, CPU the server under test then did not have.
    import aiohttp
    from tqdm import tqdm

    queue = list(reversed(specs))
    outcomes: list[Outcome] = []
    bar = tqdm(total=len(specs), desc="bench serve", unit="req", file=progress, disable=progress is None)
    async with aiohttp.ClientSession(
        base_url=url,
        connector=aiohttp.TCPConnector(limit=concurrency + 8),
        timeout=aiohttp.ClientTimeout(total=duration_s + 30),
        headers={"authorization": f"Bearer {api_key}"} if api_key else None,
    ) as client:

        async def worker() -> None:
            while queue:
                spec = queue.pop()
                out = Outcome(spec.tier, "ok", index=len(specs) - len(queue) - 1)
                try:
                    await _one(client, model, spec, out)
                except (aiohttp.ClientError, TimeoutError) as e:
                    out.status = f"http_error:{type(e).__name__}"
                except asyncio.CancelledError:
                    # In flight at `duration_s`: sent, and its first token may be in the server's
                    # figures, so it counts (it was dropped, and the report said fewer were sent).
                    out.status = CUT_OFF
                    outcomes.append(out)
                    raise
                outcomes.append(out)
                bar.update()

        tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=duration_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    bar.close()
    return outcomes


def drive_in_child(
    url: str,
    model: str,
    specs: list[Spec],
    concurrency: int,
    duration_s: float,
    cpus: set[int] | None = None,
    api_key: str | None = None,
) -> list[Outcome]:
    """Run `drive` in a fresh interpreter (`python -m tierserve.server.loadgen`), JSON in and out;
    on `cpus` only, where given (Linux). Where this process's stderr is a terminal, the child
    draws its progress bar there."""
    import os
    import subprocess

    import tierserve

    root = str(Path(tierserve.__file__).resolve().parents[1])  # importable even when not installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}

    job = {
        "url": url,
        "model": model,
        "specs": [asdict(x) for x in specs],
        "concurrency": concurrency,
        "duration_s": duration_s,
        "api_key": api_key,  # on the child's stdin, never on a command line
    }
    show = sys.stderr.isatty()
    proc = subprocess.run(
        [sys.executable, "-m", "tierserve.server.loadgen"],
        input=json.dumps({**job, "progress": show}),
        stdout=subprocess.PIPE,
        stderr=None if show else subprocess.PIPE,  # on the terminal: the bar, and any error
        text=True,
        timeout=duration_s + 120,
        check=False,
        env=env,
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
    )
    if proc.returncode != 0:
        where = "its error is above" if proc.stderr is None else proc.stderr[-4000:]
        raise RuntimeError(f"the load generator failed (exit code {proc.returncode}): {where}")
    return [Outcome(**o) for o in json.loads(proc.stdout)]


def _client_main() -> None:
    job = json.loads(sys.stdin.read())
    specs = [Spec(**x) for x in job["specs"]]
    progress = sys.stderr if job.get("progress") else None
    outcomes = asyncio.run(
        drive(
            job["url"],
            job["model"],
            specs,
            job["concurrency"],
            job["duration_s"],
            progress,
            job.get("api_key"),
        )
    )
    json.dump([asdict(o) for o in outcomes], sys.stdout)


if __name__ == "__main__":  # the child process of `drive_in_child`
    _client_main()
