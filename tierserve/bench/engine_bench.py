"""`tierserve bench engine`: the real engine on a model against Hugging Face generate().

Same weights everywhere (the seeded demo model, copied into a transformers
`LlamaForCausalLM`, or a local checkpoint that both sides load), greedy decoding, EOS
ignored so every request runs to its own max_tokens. Throughput counts only the tokens
each request asked for. Then P0's TTFT, alone and under a flood of P2 requests (policy
hybrid). Importing this module is cheap.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierserve.bench.host import HostMonitor
from tierserve.cli_args import cpu_threads, device_name, fail, int_between, positive_int

if TYPE_CHECKING:
    from tierserve.config import EngineConfig
    from tierserve.executors.pytorch.executor import TorchExecutor


PROG = "tierserve bench engine"
# The demo model's byte tokens: its ids 256 and up are BOS, EOS and PAD.
DEMO_TOKEN_IDS = range(256)

DESCRIPTION = """\
Run tierserve's engine on a model -- the demo model (random weights, made at start-up;
nothing is downloaded) or a local Hugging Face checkpoint given with --model -- and
compare its throughput with Hugging Face transformers' generate() on the same weights:
one request at a time, and one left-padded batch. The prompts are random token ids.
Decoding is greedy and ignores end-of-sequence, so every request produces its own
max_tokens. Then it measures P0's time to first token alone and behind a flood of P2
requests.

The engine and the padded batch take turns --repeats times; the speed-up is the median of
the pairs' ratios. On a busy host the figures drop and scatter; the report says when the
host was busy."""


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(
    num_prompts: int,
    seed: int,
    prompt_range: tuple[int, ...] = (16, 256),
    output_range: tuple[int, ...] = (16, 128),
    lengths: list[tuple[int, int]] | None = None,
    token_ids: Sequence[int] = DEMO_TOKEN_IDS,
) -> Workload:
    """Seeded prompts of tokens drawn from `token_ids` (default: the demo model's bytes), each
    with its own max_tokens: lengths drawn uniformly from the ranges, or the given (prompt,
    output) `lengths`."""
    rng = random.Random(seed)
    (lo, hi), (out_lo, out_hi) = prompt_range, output_range
    if lengths is None:
        prompts = [[rng.choice(token_ids) for _ in range(rng.randint(lo, hi))] for _ in range(num_prompts)]
        return Workload(prompts, [rng.randint(out_lo, out_hi) for _ in range(num_prompts)])
    prompts = [[rng.choice(token_ids) for _ in range(n)] for n, _ in lengths]
    return Workload(prompts, [m for _, m in lengths])


def prompt_token_ids(model: str, executor: TorchExecutor) -> Sequence[int]:
    """The ids a prompt draws from: the demo model's bytes, or every id of the checkpoint's
    vocabulary but its BOS and EOS (an EOS inside a prompt reads as a finished text)."""
    if model == "demo":
        return DEMO_TOKEN_IDS
    config = executor.model.config
    special = {config.bos_token_id, *config.eos_token_ids, *executor.eos_token_ids}
    return [i for i in range(config.vocab_size) if i not in special]


MIN_MEDIAN_PROMPT = 4  # tokens: below, `--lengths-from` says that its scale shrank every prompt


def trace_lengths(
    path: str, num_prompts: int, seed: int, prompt_max: int, output_max: int
) -> list[tuple[int, int]]:
    """(prompt, output) lengths of `num_prompts` requests drawn (seeded) from a request trace
    (an Azure or BurstGPT CSV, or Mooncake JSON lines), scaled so that the longest drawn
    prompt has `prompt_max` tokens and the longest output `output_max`: the trace's spread
    of lengths at the demo model's scale."""
    from tierserve.workloads.traces import load_trace

    records = load_trace(path)
    if not records:
        raise ValueError(f"{path}: the trace has no requests")
    rng = random.Random(seed)
    drawn = [rng.choice(records) for _ in range(num_prompts)]
    prompts = [r.num_prompt_tokens for r in drawn]
    outputs = [max(r.num_output_tokens, 1) for r in drawn]  # a trace may record 0
    prompt_scale, output_scale = prompt_max / max(prompts), output_max / max(outputs)
    return [
        (max(1, round(p * prompt_scale)), max(1, round(o * output_scale)))
        for p, o in zip(prompts, outputs, strict=True)
    ]


def _engine(executor: TorchExecutor, config: EngineConfig) -> Any:
    from tierserve.clock import WallClock
    from tierserve.engine import Engine

    return Engine(config, "hybrid", executor, WallClock())


def _request(
    rid: str, prompt: list[int], max_tokens: int, tier: Any, now: float, repetition_penalty: float = 1.0
) -> Any:
    """`repetition_penalty`: the model's (generation_config.json), which Hugging Face's greedy
    `generate()` applies too; the runs that time P0 beside a flood leave it off."""
    from tierserve.request import Request, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, repetition_penalty=repetition_penalty)
    return Request(rid, list(prompt), params, tier=tier, tenant="bench", arrival_time=now)


def run_tierserve(
    executor: TorchExecutor, config: EngineConfig, w: Workload
) -> tuple[float, list[list[int]]]:
    """All prompts submitted at once; continuous batching. Returns (tokens/s, outputs)."""
    from tierserve.bench.output import progress_bar
    from tierserve.tiers import Tier

    engine = _engine(executor, config)
    penalty = executor.spec.sampling_defaults.repetition_penalty or 1.0
    reqs = [
        _request(f"r{i}", p, m, Tier.P1, engine.clock.now(), penalty)
        for i, (p, m) in enumerate(zip(w.prompts, w.max_tokens, strict=True))
    ]
    start = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    with progress_bar(total=w.num_output_tokens, desc="tierserve", leave=False) as bar:
        while engine.has_unfinished():
            bar.update(sum(len(o.new_token_ids) for o in engine.step()))
    elapsed = time.perf_counter() - start
    return w.num_output_tokens / elapsed, [r.output_token_ids for r in reqs]


def load_executor(model: str, device: str, threads: int) -> TorchExecutor:
    """The engine's executor for `model` ("demo" or a local Hugging Face directory), loaded
    as `tierserve serve --backend torch` loads it. The thread count is set first: the
    executor's start-up calibration and every contender run with it."""
    import torch

    from tierserve.executors.pytorch.executor import build_torch_executor

    if threads > 0:
        torch.set_num_threads(threads)  # the same for the engine and the HF baselines
    executor, _ = build_torch_executor(model, device)
    return executor


def load_hf_model(directory: str, executor: TorchExecutor) -> Any:
    """transformers' own model of the checkpoint in `directory`, in the executor's dtype, on its
    device, EOS ignored as the engine's requests ignore it. Local files only."""
    from transformers import AutoModelForCausalLM

    dtype = executor.model.model.embed_tokens.weight.dtype
    hf: Any = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    hf = hf.eval().to(executor.device)
    hf.generation_config.eos_token_id = None
    return hf


def build_hf_model(executor: TorchExecutor) -> Any:
    """A transformers LlamaForCausalLM holding the executor's (demo) weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = executor.model.config
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_size,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=None,
        pad_token_id=0,
    )
    hf: Any = LlamaForCausalLM(hf_config)
    hf = hf.eval().to(executor.device)
    result = hf.load_state_dict(executor.model.checkpoint_tensors(), strict=False)
    # A tied model has no lm_head tensor of its own: transformers ties it to the embeddings.
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise RuntimeError(f"weights do not map onto transformers' Llama: {result}")
    hf.generation_config.eos_token_id = None
    return hf


def run_hf_serial(hf: Any, w: Workload) -> tuple[float, list[list[int]]]:
    import torch

    from tierserve.bench.output import progress_bar

    outputs = []
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt, n in progress_bar(
            list(zip(w.prompts, w.max_tokens, strict=True)), desc="HF one at a time", leave=False
        ):
            ids = torch.tensor([prompt], device=hf.device)
            out = hf.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return w.num_output_tokens / (time.perf_counter() - start), outputs


def run_hf_batched(hf: Any, w: Workload, pad_id: int = 0) -> float:
    """One left-padded batch; runs to the longest max_tokens, counts only the wanted tokens."""
    import torch

    width = max(map(len, w.prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in w.prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in w.prompts], device=hf.device)
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(w.max_tokens), do_sample=False)
    return w.num_output_tokens / (time.perf_counter() - start)


def _until_first_token(engine: Any, req: Any) -> float:
    while req.first_token_time is None:
        engine.step()
    ttft: float = req.ttft_s
    return ttft


def measure_p0_ttft(
    executor: TorchExecutor, config: EngineConfig, p0_prompts: list[list[int]], flood: Workload | None
) -> tuple[list[float], list[float]]:
    """TTFTs of P0 requests arriving at step boundaries, and arriving as a step begins.

    With `flood`, all its requests are submitted as P2 first; the first P0 arrives with
    the flood still queued, the later ones while it runs. The second list charges each
    P0 the step in flight when it arrived (a request cannot join a running step).
    """
    from tierserve.tiers import Tier

    engine = _engine(executor, config)
    now = engine.clock.now
    for i, (p, m) in enumerate(zip(flood.prompts, flood.max_tokens, strict=True) if flood else []):
        engine.add_request(_request(f"flood{i}", p, m, Tier.P2, now()))
    boundary, in_flight = [], []
    for i, prompt in enumerate(p0_prompts):
        req = _request(f"p0-{i}", prompt, 1, Tier.P0, now())
        engine.add_request(req)
        boundary.append(_until_first_token(engine, req))
        engine.step()  # the flood moves on between measurements
        arrival = now()
        engine.step()  # the step that was running when the P0 arrived
        # The same tokens reversed: a prompt the prefix cache has not seen.
        req = _request(f"p0-late-{i}", prompt[::-1], 1, Tier.P0, arrival)
        engine.add_request(req)
        in_flight.append(_until_first_token(engine, req))
    for rid in [f"flood{i}" for i in range(len(flood.prompts) if flood else 0)]:
        engine.abort(rid)
    return boundary, in_flight


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _warm_up_workload(num_prompts: int, seed: int, max_model_len: int, token_ids: Sequence[int]) -> Workload:
    """Short requests that pay the one-time costs; each half of the context holds a prompt or
    an output (the demo model's 4096 tokens hold them whole)."""
    half = max_model_len // 2
    return make_workload(
        num_prompts,
        seed,
        prompt_range=(min(16, half), min(256, half)),
        output_range=(min(4, half), min(8, half)),
        token_ids=token_ids,
    )


def bench(
    args: argparse.Namespace, executor: TorchExecutor, lengths: list[tuple[int, int]] | None = None
) -> dict[str, Any]:
    """Run every contender on `executor` (`args.model` loaded by `load_executor`); `lengths`:
    the workload's (prompt, output) lengths, else drawn uniformly from `--prompt-tokens` and
    `--output-tokens`."""
    from tierserve.config import EngineConfig, SchedulerConfig
    from tierserve.scheduling.hybrid import HybridOptions

    hybrid = HybridOptions(p0_step_tokens=args.p0_step_tokens, p0_solo_prefill=args.p0_solo_prefill)
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens),
        policy_options={"hybrid": hybrid},
    )
    ids = prompt_token_ids(args.model, executor)
    res = _throughput(args, executor, config, ids, lengths)
    res.update(_p0_ttft(args, executor, config, ids))
    return res


def _throughput(
    args: argparse.Namespace,
    executor: TorchExecutor,
    config: EngineConfig,
    ids: Sequence[int],
    lengths: list[tuple[int, int]] | None,
) -> dict[str, Any]:
    """The engine's tokens/s on the workload, and transformers' beside it (unless skipped)."""
    import importlib.util

    import torch

    max_model_len = executor.spec.max_model_len
    w = make_workload(
        args.num_prompts, args.seed, tuple(args.prompt_tokens), tuple(args.output_tokens), lengths, ids
    )
    run_tierserve(executor, config, _warm_up_workload(4, args.seed + 1, max_model_len, ids))
    hf = None
    if not args.skip_hf and importlib.util.find_spec("transformers") is not None:
        hf = build_hf_model(executor) if args.model == "demo" else load_hf_model(args.model, executor)
        run_hf_serial(hf, _warm_up_workload(2, args.seed + 1, max_model_len, ids))
    # The engine and the padded batch take turns, `repeats` times: a slow spell of the shared
    # machine hits both runs of a pair, so the speed-up is the median of the pairs' ratios.
    runs, hf_batched = [], []
    for _ in range(args.repeats):
        runs.append(run_tierserve(executor, config, w))
        if hf is not None:
            hf_batched.append(run_hf_batched(hf, w))
    ts_tps = statistics.median(tps for tps, _ in runs)
    res: dict[str, Any] = {
        "model": args.model,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "num_prompts": args.num_prompts,
        "lengths_from": args.lengths_from,
        "num_prompt_tokens": sum(map(len, w.prompts)),
        "num_output_tokens": w.num_output_tokens,
        "tierserve_tokens_per_s": ts_tps,
    }
    if hf is None:
        print("transformers baselines skipped", file=sys.stderr)
        return res
    res["hf_serial_tokens_per_s"], hf_out = run_hf_serial(hf, w)
    res["hf_batched_tokens_per_s"] = statistics.median(hf_batched)
    ratios = [tps / hf_tps for (tps, _), hf_tps in zip(runs, hf_batched, strict=True)]
    res["speedup_vs_hf_batched"] = statistics.median(ratios)
    res["speedup_vs_hf_batched_runs"] = ratios
    res["speedup_vs_hf_serial"] = ts_tps / res["hf_serial_tokens_per_s"]
    res["greedy_agreement_with_hf"] = min(  # the worst of the engine's runs
        sum(a == b for a, b in zip(out, hf_out, strict=True)) / len(w.prompts) for _, out in runs
    )
    return res


def _p0_ttft(
    args: argparse.Namespace, executor: TorchExecutor, config: EngineConfig, ids: Sequence[int]
) -> dict[str, Any]:
    """P0's time to first token alone, and behind a flood of P2 requests."""
    # Distinct prompts everywhere, so no P0 request is served from the prefix cache.
    p0_len = min(128, executor.spec.max_model_len - 1)  # a P0 request asks for one token
    p0_prompts = make_workload(
        2 * args.num_p0, args.seed + 2, prompt_range=(p0_len, p0_len), token_ids=ids
    ).prompts
    alone, _ = measure_p0_ttft(executor, config, p0_prompts[: args.num_p0], None)
    flood = make_workload(
        args.flood, args.seed + 3, tuple(args.prompt_tokens), tuple(args.output_tokens), token_ids=ids
    )
    flood_boundary, flood_in_flight = measure_p0_ttft(executor, config, p0_prompts[args.num_p0 :], flood)
    return {
        "p0_ttft_alone_s": _median(alone),
        "p0_ttft_under_flood_s": _median(flood_boundary),
        "p0_ttft_flood_ratio": _median(flood_boundary) / _median(alone),
        "p0_ttft_under_flood_max_s": max(flood_boundary),
        "p0_ttft_under_flood_in_flight_s": _median(flood_in_flight),
        "num_flood_requests": args.flood,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "p0_step_tokens": args.p0_step_tokens,
        "p0_solo_prefill": args.p0_solo_prefill,
    }


_ROWS = (
    ("tierserve engine (continuous batching), median", "tierserve_tokens_per_s", "tok/s"),
    ("HF generate(), one request at a time", "hf_serial_tokens_per_s", "tok/s"),
    ("HF generate(), one left-padded batch, median", "hf_batched_tokens_per_s", "tok/s"),
    ("speed-up vs HF padded batch (target >= 2)", "speedup_vs_hf_batched", "x"),
    ("greedy outputs identical to HF (share)", "greedy_agreement_with_hf", ""),
    ("P0 TTFT alone (median)", "p0_ttft_alone_s", "s"),
    ("P0 TTFT under P2 flood (median)", "p0_ttft_under_flood_s", "s"),
    ("flood / alone (target <= 2)", "p0_ttft_flood_ratio", "x"),
    ("P0 TTFT under flood, arriving mid-step", "p0_ttft_under_flood_in_flight_s", "s"),
)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "engine",
        help="real engine on the demo model or a checkpoint vs Hugging Face generate()",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="demo",
        metavar="DIR",
        help="'demo' (random weights made at start-up, nothing downloaded) or a local Hugging Face model "
        "directory with config.json, *.safetensors and tokenizer.json, which transformers loads too "
        "(default: demo)",
    )
    _add_workload_args(p)
    _add_engine_args(p)
    _add_run_args(p)
    p.set_defaults(func=run)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """The requests: how many, their lengths, their seed."""
    p.add_argument(
        "--num-prompts",
        type=int_between(1, 100_000),
        default=32,
        help="requests in the workload, at most 100,000 (default: 32)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the workload's lengths and tokens (default: 0)"
    )
    p.add_argument(
        "--prompt-tokens",
        type=positive_int,
        nargs=2,
        default=[16, 256],
        metavar=("MIN", "MAX"),
        help="each prompt's length in tokens, drawn in this range (default: 16 256)",
    )
    p.add_argument(
        "--output-tokens",
        type=positive_int,
        nargs=2,
        default=[16, 128],
        metavar=("MIN", "MAX"),
        help="each request's max_tokens, drawn in this range (default: 16 128)",
    )
    p.add_argument(
        "--lengths-from",
        metavar="TRACE",
        help="draw the prompts' and outputs' lengths from a request trace (Azure .csv or Mooncake "
        ".jsonl), scaled so the longest are --prompt-tokens MAX and --output-tokens MAX",
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Where the engine runs and the scheduling it is measured with (P0 behind a flood)."""
    p.add_argument(
        "--device",
        type=device_name,
        default="cpu",
        help="cpu or cuda; cuda needs a CUDA build of torch (default: cpu)",
    )
    p.add_argument(
        "--flood",
        type=int_between(1, 100_000),
        default=64,
        help="P2 requests submitted before the P0 ones, at most 100,000 (default: 64)",
    )
    p.add_argument(
        "--num-p0", type=positive_int, default=5, help="P0 requests measured per scenario (default: 5)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=2048,
        help="tokens one engine step may process at most (default: 2048)",
    )
    p.add_argument(
        "--p0-step-tokens",
        type=positive_int,
        default=128,
        help="prefill tokens of other tiers a step that serves P0 may take (default: 128)",
    )


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Threads, repeats, the baselines and the output."""
    p.add_argument(
        "--threads",
        type=cpu_threads,
        default=1,
        help="torch CPU threads for every contender (0 = torch's default); 1, the default, is "
        "steadiest on a shared box",
    )
    p.add_argument(
        "--p0-solo-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a step that prefills P0 leaves P2-P3 decodes out (on a CPU they cost as much as the prefill)",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        help="runs of the engine and of HF's padded batch, taking turns; the speed-up is the median "
        "of the pairs' ratios, tokens/s the median of each side's runs (default: %(default)s)",
    )
    p.add_argument(
        "--skip-hf", action="store_true", help="skip the Hugging Face transformers baselines (faster)"
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run(args: argparse.Namespace) -> int:
    from tierserve.executors.pytorch.hf_config import ModelLoadError
    from tierserve.workloads.traces import TraceFormatError

    for name in ("prompt_tokens", "output_tokens"):
        low, high = getattr(args, name)
        if low > high:
            flag = "--" + name.replace("_", "-")
            return fail(PROG, f"{flag} MIN MAX needs MIN <= MAX, got {low} {high}")
    lengths = None
    if args.lengths_from:
        try:
            lengths = trace_lengths(
                args.lengths_from, args.num_prompts, args.seed, args.prompt_tokens[1], args.output_tokens[1]
            )
        except (OSError, TraceFormatError, ValueError) as e:
            return fail(PROG, f"--lengths-from: {e}")
        median = sorted(p for p, _ in lengths)[len(lengths) // 2]
        # A few huge rows set the scale (a new user's trial: one of 10M tokens); not said where
        # the longest prompt asked for is itself that short.
        if median < MIN_MEDIAN_PROMPT <= args.prompt_tokens[1] // 16:
            print(
                f"note: --lengths-from: the longest drawn prompt is scaled to {args.prompt_tokens[1]} "
                f"tokens, and the median prompt comes to {median}: a few very long rows set the scale",
                file=sys.stderr,
            )
    monitor = HostMonitor()
    begin = time.perf_counter()
    try:
        executor = load_executor(args.model, args.device, args.threads)
    except ModelLoadError as e:
        return fail(PROG, f"--model: {e}")
    too_long = _too_long(args, executor)
    if too_long:
        return fail(PROG, too_long)
    res = bench(args, executor, lengths)
    res["elapsed_s"] = time.perf_counter() - begin
    host = monitor.finish()
    res["host"] = host.as_dict()
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        _print_report(res, host.warning())
    return 0


def _too_long(args: argparse.Namespace, executor: TorchExecutor) -> str | None:
    """Why the longest request the flags allow does not fit, or None: a request holds at most
    the model's context, or what the K/V cache holds if that is less."""
    max_model_len = executor.spec.max_model_len
    cache_bound = max_model_len == executor.pool.num_device_blocks * executor.spec.block_size
    (_, prompt_max), (_, output_max) = args.prompt_tokens, args.output_tokens
    if prompt_max + output_max <= max_model_len:
        return None
    limit = f"the K/V cache's {max_model_len}" if cache_bound else f"the model's context of {max_model_len}"
    return (
        f"--prompt-tokens MAX + --output-tokens MAX is {prompt_max} + {output_max} = "
        f"{prompt_max + output_max} tokens, more than {limit}"
    )


def _print_report(res: dict[str, Any], host_warning: str | None) -> None:
    head = (
        f"{res['num_prompts']} prompts ({res['num_prompt_tokens']} tokens"
        f"{', lengths from ' + res['lengths_from'] if res['lengths_from'] else ''}), "
        f"{res['num_output_tokens']} output tokens"
    )
    model = "demo model" if res["model"] == "demo" else f"model {res['model']}"
    threads = f"{res['threads']} thread{'' if res['threads'] == 1 else 's'}"
    print(f"{model} on {res['device']} ({threads}): {head}")
    for label, key, unit in _ROWS:
        if key in res:
            print(f"  {label:<48} {res[key]:>10.4g} {unit}".rstrip())
    if "speedup_vs_hf_batched_runs" in res:
        pairs = ", ".join(f"{r:.2f}" for r in res["speedup_vs_hf_batched_runs"])
        print(f"  (speed-up of each engine / padded-batch pair, in turn: {pairs})")
    if host_warning:
        print(host_warning)
