"""`tierserve bench sim-check`: the torch executor's measured step times against the
simulator's prediction for the same model shape and the same steps.

Each shape is one engine step, handed to `TorchExecutor.execute` as the scheduler hands
it: decodes of requests holding C computed tokens and one sampled token, and prefill
chunks that end their prompts (so each samples, as the cost model's LM head assumes).
The weights are random, made on the device at start-up; nothing is downloaded. The
prediction is `CostModel(gpu, model, tp=1).step_s` for the chunks of the step that ran,
with the model's K/V and weights at the precision that ran. On a CPU it is still the
GPU's prediction: there the ratio only says how far the CPU is from that GPU.
Importing this module is cheap.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierserve.bench.host import HostMonitor
from tierserve.bench.output import emit, make_out_folder
from tierserve.cli_args import cpu_threads, positive_int
from tierserve.executors.base import Executor, ScheduledSeq, StepBatch
from tierserve.executors.sim.cost_model import DEFAULT_ACTIVATION_RESERVE_BYTES, CostModel, SeqChunk
from tierserve.executors.sim.gpus import GiB, GpuProfile, get_gpu
from tierserve.model_config import ModelConfig
from tierserve.request import Request, RequestStatus

if TYPE_CHECKING:
    import torch

    from tierserve.executors.pytorch.executor import TorchExecutor
    from tierserve.executors.pytorch.hf_config import DecoderOptions

BLOCK_SIZE = 16
DTYPES = ("float32", "bfloat16", "float16")
SHAPE_FORMAT = (
    "parts joined by '+': pN (a prefill chunk of N tokens), pN@C (the same after C cached tokens), "
    "dBxC (B decodes, each after C cached tokens)"
)
# Prefill of one sequence, decodes at 1K context, and one mixed step: seconds on a GPU for
# an 8 B model, about 10 s on one CPU core for the demo model.
DEFAULT_SHAPES = (
    "p128",
    "p512",
    "p2048",
    "d1x1024",
    "d8x1024",
    "d32x1024",
    "d128x1024",
    "d32x1024+p512",
)
_PART = re.compile(r"p(\d+)(?:@(\d+))?|d(\d+)x(\d+)")


@dataclass(frozen=True, slots=True)
class Shape:
    """One engine step: decodes (one token each) and prefill chunks, as the cost model's chunks."""

    name: str
    decodes: tuple[SeqChunk, ...]
    prefills: tuple[SeqChunk, ...]

    @property
    def chunks(self) -> list[SeqChunk]:
        """In the order of `StepBatch.seqs`: decodes first."""
        return [*self.decodes, *self.prefills]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def max_len(self) -> int:
        """The longest sequence's length once the step has run."""
        return max(c.num_context_tokens + c.num_tokens for c in self.chunks)

    def num_blocks(self, block_size: int) -> int:
        """K/V blocks the step's requests hold: one set per sequence, none shared."""
        return sum(-(-(c.num_context_tokens + c.num_tokens) // block_size) for c in self.chunks)


def parse_shape(text: str) -> Shape:
    decodes: list[SeqChunk] = []
    prefills: list[SeqChunk] = []
    for part in text.split("+"):
        m = _PART.fullmatch(part.strip())
        if m is None:
            raise ValueError(f"shape {text!r}: cannot read {part!r}; expected {SHAPE_FORMAT}")
        if m[1] is not None:
            num_tokens, context = int(m[1]), int(m[2] or 0)
            if num_tokens < 1:
                raise ValueError(f"shape {text!r}: a prefill chunk needs at least one token")
            prefills.append(SeqChunk(num_tokens, context))
        else:
            batch, context = int(m[3]), int(m[4])
            if batch < 1 or context < 1:
                raise ValueError(
                    f"shape {text!r}: decodes need B >= 1 and C >= 1 (a decode follows a prompt)"
                )
            decodes.extend([SeqChunk(1, context)] * batch)
    return Shape(text, tuple(decodes), tuple(prefills))


def _shape_arg(text: str) -> Shape:
    try:
        return parse_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_batch(shape: Shape, block_size: int, vocab_size: int, seed: int = 0) -> StepBatch:
    """The `StepBatch` the engine hands its executor for this step.

    A decode's request holds a prompt of C tokens plus one sampled token, C of them
    computed; a prefill chunk's request holds a prompt of C + N tokens, C computed, so the
    chunk is its prompt's last and samples. Each request holds blocks for all its known
    tokens, as `KVCacheManager.admit` and `grow` give them: distinct, low ids first.
    """
    rng = random.Random(seed)
    seqs: list[ScheduledSeq] = []
    next_block = 0
    for i, chunk in enumerate(shape.chunks):
        is_decode = i < len(shape.decodes)
        context = chunk.num_context_tokens
        num_prompt = context if is_decode else context + chunk.num_tokens
        req = Request(f"{shape.name}/{i}", [rng.randrange(vocab_size) for _ in range(num_prompt)])
        if is_decode:
            req.token_ids.append(rng.randrange(vocab_size))
        req.num_computed_tokens = context
        req.status = RequestStatus.RUNNING
        num_blocks = -(-req.num_tokens // block_size)
        req.block_ids = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        seqs.append(ScheduledSeq(req, chunk.num_tokens))
    num_decodes = len(shape.decodes)
    return StepBatch(seqs[:num_decodes], seqs[num_decodes:])


def batch_chunks(batch: StepBatch) -> list[SeqChunk]:
    """The cost model's view of a step, as `SimExecutor.execute` takes it."""
    return [SeqChunk(s.num_tokens, s.start) for s in batch.seqs]


@dataclass(frozen=True, slots=True)
class Row:
    shape: str
    num_seqs: int
    num_tokens: int
    measured_s: float  # median of the timed runs
    predicted_s: float
    ratio: float  # measured / predicted
    runs_s: tuple[float, ...]


def check_shapes(
    executor: Executor, cost: CostModel, shapes: Sequence[Shape], repeats: int, seed: int = 0
) -> list[Row]:
    """Run each shape's step once to warm up, then `repeats` times; compare the median with
    the cost model's prediction for the same step."""
    rows = []
    for shape in shapes:
        batch = build_batch(shape, executor.spec.block_size, cost.model.vocab_size, seed)
        predicted = cost.step_s(batch_chunks(batch))
        executor.execute(batch)
        runs = tuple(executor.execute(batch).duration_s for _ in range(repeats))
        measured = statistics.median(runs)
        rows.append(
            Row(shape.name, len(batch), batch.num_tokens, measured, predicted, measured / predicted, runs)
        )
    return rows


def _available_bytes(device: torch.device) -> int | None:
    """Free device memory (CUDA) or MemAvailable (Linux CPU); None where unknown."""
    from tierserve.executors.pytorch.loader import free_bytes

    return free_bytes(device)


def check_fits(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    num_blocks: int,
    block_size: int = BLOCK_SIZE,
) -> None:
    """ValueError when `config`'s weights in `dtype` and `num_blocks` K/V blocks would not fit
    in `device`'s free memory (checked before anything is built or written)."""
    import torch

    from tierserve.executors.pytorch.kv_pool import KVLayout

    layout = KVLayout(
        config.num_hidden_layers, config.num_key_value_heads, config.head_size, block_size, dtype
    )
    element_bytes = torch.empty((), dtype=dtype).element_size()
    weight_bytes = config.num_params * element_bytes
    kv_bytes = num_blocks * layout.bytes_per_block
    available = _available_bytes(device)
    if available is None or weight_bytes + kv_bytes + DEFAULT_ACTIVATION_RESERVE_BYTES <= available:
        return
    # Smaller shapes help only when the weights leave room for some K/V.
    if weight_bytes + DEFAULT_ACTIVATION_RESERVE_BYTES > available:
        half = " or --dtype bfloat16" if element_bytes > 2 else ""
        hint = f"the weights alone do not fit: give a smaller --model{half}"
    else:
        hint = "give fewer decodes or shorter contexts with --shape"
    raise ValueError(
        f"{config.name} in {str(dtype).removeprefix('torch.')} needs {weight_bytes / GiB:.1f} GiB of "
        f"weights, {kv_bytes / GiB:.1f} GiB of K/V for the largest shape ({num_blocks} blocks) and "
        f"{DEFAULT_ACTIVATION_RESERVE_BYTES / GiB:.0f} GiB for activations; {device} has "
        f"{available / GiB:.1f} GiB free: {hint}"
    )


def build_executor(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    num_blocks: int,
    block_size: int = BLOCK_SIZE,
    options: DecoderOptions | None = None,
) -> TorchExecutor:
    """A `TorchExecutor` for `config` with random weights and `num_blocks` K/V blocks, no host
    pool; ValueError when they would not fit in the device's free memory (`check_fits`).
    `options`: the checkpoint's biases and norms (none: plain Llama, as the built-in models)."""
    from tierserve.executors.pytorch.executor import TorchExecutor
    from tierserve.executors.pytorch.hf_config import PLAIN_LLAMA
    from tierserve.executors.pytorch.kv_pool import KVLayout, KVPool
    from tierserve.executors.pytorch.loader import make_random_model

    check_fits(config, device, dtype, num_blocks, block_size)
    layout = KVLayout(
        config.num_hidden_layers, config.num_key_value_heads, config.head_size, block_size, dtype
    )
    model = make_random_model(config, device, dtype, options=options or PLAIN_LLAMA)
    pool = KVPool(layout, num_blocks, 0, device)
    return TorchExecutor(model, pool, max_model_len=config.max_position_embeddings)


@dataclass(frozen=True)
class Setup:
    """What `measure` runs: the settings of `tierserve bench sim-check`, checked by `checked_setup`."""

    config: ModelConfig
    gpu: GpuProfile
    shapes: list[Shape]
    device: torch.device
    dtype: str
    repeats: int  # timed runs of each shape
    options: DecoderOptions | None = None  # a model directory's biases and norms (Qwen's)


def checked_setup(
    model: str = "demo",
    device: str = "cpu",
    dtype: str | None = None,
    gpu: str = "h200",
    shapes: Sequence[Shape] | None = None,
    repeats: int = 5,
) -> Setup:
    """The settings checked, before anything is built or written; ValueError for a bad one."""
    from tierserve.executors.sim.executor import get_model

    config = get_model(model)
    profile = get_gpu(gpu)
    checked = _checked_shapes(config, shapes, repeats, dtype)
    dev = _device(device)
    dtype = dtype or ("float32" if dev.type == "cpu" else "bfloat16")
    import torch

    check_fits(config, dev, getattr(torch, dtype), max(s.num_blocks(BLOCK_SIZE) for s in checked))
    return Setup(config, profile, checked, dev, dtype, repeats, _decoder_options(model))


def _decoder_options(model: str) -> DecoderOptions | None:
    """A model directory's biases and norms, which its steps compute (a Qwen3 directory was
    timed as a plain Llama, without its q/k norms); None for a built-in model."""
    from tierserve.executors.pytorch.hf_config import parse_hf_config
    from tierserve.model_config import KNOWN_MODELS

    path = Path(model)
    if model.lower() in KNOWN_MODELS or not (path.is_dir() or path.is_file()):
        return None
    return parse_hf_config(path / "config.json" if path.is_dir() else path, simulated=True).options


def measure(setup: Setup, seed: int = 0) -> dict[str, Any]:
    """Time each of `setup`'s shapes and predict it for its GPU: the result `tierserve bench
    sim-check` writes."""
    import torch

    torch_dtype: torch.dtype = getattr(torch, setup.dtype)
    # The prediction for the precision that runs: K/V and weights at its element size.
    run_config = replace(setup.config, dtype_bytes=torch.empty((), dtype=torch_dtype).element_size())
    begin = time.perf_counter()
    executor = build_executor(
        run_config,
        setup.device,
        torch_dtype,
        max(s.num_blocks(BLOCK_SIZE) for s in setup.shapes),
        options=setup.options,
    )
    cost = CostModel(setup.gpu, run_config, tp=1)
    rows = check_shapes(executor, cost, setup.shapes, setup.repeats, seed)
    device_name = _device_name(setup.device)
    notes = []
    if setup.gpu.name.split("-")[0] not in device_name.lower():
        notes.append(
            f"the prediction is for an {setup.gpu.name}; on this device ({device_name}) the ratio only "
            f"says how far it is from that GPU"
        )
    return {
        "model": setup.config.name,
        "device": str(setup.device),
        "device_name": device_name,
        "dtype": setup.dtype,
        "gpu": setup.gpu.name,
        "tp": 1,
        "repeats": setup.repeats,
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": executor.pool.num_device_blocks,
        "step_overhead_s": setup.gpu.efficiency.step_overhead_s,  # in every prediction
        "torch_version": torch.__version__,
        "rows": [asdict(r) for r in rows],
        "median_ratio": statistics.median(r.ratio for r in rows),
        "notes": notes,
        "elapsed_s": time.perf_counter() - begin,
    }


def _checked_shapes(
    config: ModelConfig, shapes: Sequence[Shape] | None, repeats: int, dtype: str | None
) -> list[Shape]:
    """The shapes to run (the defaults where none are given); ValueError for a shape past the
    model's context, no shapes, no repeats or an unknown dtype."""
    shapes = [parse_shape(s) for s in DEFAULT_SHAPES] if shapes is None else list(shapes)
    if not shapes:
        raise ValueError("no shapes to run")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for shape in shapes:
        if shape.max_len > config.max_position_embeddings:
            raise ValueError(
                f"shape {shape.name!r} reaches {shape.max_len} tokens; {config.name} holds at most "
                f"{config.max_position_embeddings}"
            )
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known dtypes: {', '.join(DTYPES)}")
    return shapes


def _device(device: str) -> torch.device:
    """The torch device; ValueError for one other than cpu or cuda, or cuda without a GPU."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:  # torch's message lists twenty device types this command does not run on
        raise ValueError(f"device must be cpu or cuda, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device} asked for, but this torch ({torch.__version__}) sees no CUDA device"
        )
    return dev


def _device_name(dev: torch.device) -> str:
    import torch

    if dev.type == "cuda":
        return str(torch.cuda.get_device_name(dev))
    num_threads = torch.get_num_threads()
    return f"cpu, {num_threads} thread{'s' if num_threads > 1 else ''}"


def print_table(res: dict[str, Any]) -> None:
    print(
        f"sim-check: {res['model']} in {res['dtype']} on {res['device']} ({res['device_name']}), "
        f"predicted for {res['gpu']} tp {res['tp']}, median of {res['repeats']} runs"
    )
    print(f"  {'shape':<16} {'seqs':>5} {'tokens':>7} {'measured ms':>12} {'predicted ms':>13} {'ratio':>7}")
    for r in res["rows"]:
        print(
            f"  {r['shape']:<16} {r['num_seqs']:>5} {r['num_tokens']:>7} {r['measured_s'] * 1e3:>12.3f} "
            f"{r['predicted_s'] * 1e3:>13.3f} {r['ratio']:>7.2f}"
        )
    print(f"median measured / predicted: {res['median_ratio']:.2f}")
    for note in res["notes"]:
        print(f"note: {note}")


DESCRIPTION = """\
Time real engine steps of the PyTorch executor and compare them with what the GPU
simulator predicts for the same steps, to check the simulator on a GPU you have.

Each --shape is one engine step: prefill chunks, decodes, or both. The model has the
named model's shape with random weights made on the device (nothing is downloaded). The
prediction is the simulator's for --gpu with one GPU, at the precision that ran. On a CPU
the prediction is still the GPU's, so the ratio only says how far the CPU is from it.
The JSON result goes to --out."""


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "sim-check",
        help="torch executor step times vs the simulator's prediction for the same shapes",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="demo",
        help="a known model name, or a local Hugging Face model directory (its config.json; the "
        "weights are random) (default: %(default)s)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument(
        "--gpu", default="h200", help="GPU profile the simulator predicts for (default: %(default)s)"
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        help="timed runs per shape after one warm-up; the median counts (default: 5)",
    )
    p.add_argument(
        "--shape",
        type=_shape_arg,
        action="append",
        dest="shapes",
        metavar="SHAPE",
        help=f"one step, repeatable (default: {' '.join(DEFAULT_SHAPES)}); {SHAPE_FORMAT}",
    )
    p.add_argument("--seed", type=int, default=0, help="token ids of the steps' requests")
    p.add_argument(
        "--threads",
        type=cpu_threads,
        default=1,
        help="torch CPU threads (0 = torch's default); 1, the default, is steadiest on a shared box "
        "(with 2 threads on a busy 2-core host steps took 25-125x as long)",
    )
    p.add_argument(
        "--out",
        default="bench-out/sim-check.json",
        help="JSON result file (default: %(default)s); '': write none",
    )
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    monitor = HostMonitor()
    try:
        setup = checked_setup(args.model, args.device, args.dtype, args.gpu, args.shapes, args.repeats)
        make_out_folder(args.out)
        res = measure(setup, args.seed)
    except ValueError as e:
        print(f"tierserve bench sim-check: {e}", file=sys.stderr)
        return 2
    host = monitor.finish()
    res["host"] = host.as_dict()
    warning = host.warning()
    if warning:
        res["notes"].append(warning)
    emit(res, args.out, args.json, lambda: print_table(res))
    return 0
