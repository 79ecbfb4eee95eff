"""`tierserve profile`: what the simulator predicts for a model on a GPU.

tierserve profile --model llama-3.1-70b --gpu a100-80gb --tp 8 [--prefill-tokens 2048]
                  [--batch 1 --context 2048] [--mem-util 0.9] [--json]

A model whose weights leave no room for the K/V cache does not fit: one line on stderr
that says so and names the smallest --tp that fits, and exit status 1 (bad arguments: 2;
with --json, the verdict is on stdout too, as `fits` and `reason`). A shape no engine would
run (a prefill or context beyond the model's context, a decode batch whose K/V does not
fit) is still predicted, with a note (`beyond_limits` in the JSON); so is a --tp beyond one
8-GPU node, whose all-reduces the cost model puts on NVLink (`caveats` in the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass

from tierserve.executors.sim.cost_model import DEFAULT_ACTIVATION_RESERVE_BYTES, CostModel, SeqChunk
from tierserve.executors.sim.executor import get_model
from tierserve.executors.sim.gpus import KNOWN_GPUS, get_gpu
from tierserve.model_config import KNOWN_MODELS

EXIT_DOES_NOT_FIT = 1
EXIT_BAD_ARGUMENTS = 2
_GIB = 1 << 30
_TP_TRIED = (1, 2, 4, 8, 16, 32, 64)
_GPUS_PER_NODE = 8  # an HGX/DGX board: NVLink joins no more of these SXM GPUs
MAX_SHAPE = 1 << 40  # shapes past this many tokens are typing mistakes: their float figures overflow


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "profile",
        help="predicted step times and K/V capacity for a model on a GPU",
        description="What the simulator predicts for one model on --tp GPUs of one kind: the time of a "
        "prefill and of a decode step, the K/V bytes per token, and how many tokens of K/V fit. "
        "When the weights leave no room for the K/V cache, it says the model does not fit, names the "
        "smallest --tp that fits, and exits with status 1 (bad arguments: status 2).",
    )
    p.add_argument(
        "--model",
        required=True,
        help=f"one of: {', '.join(sorted(KNOWN_MODELS))}; or a local Hugging Face model directory "
        "(its config.json is read; no weights)",
    )
    p.add_argument(
        "--gpu", required=True, help=f"one of: {', '.join(sorted(KNOWN_GPUS))} (a100, h100: the 80 GB parts)"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (default 1)")
    p.add_argument(
        "--prefill-tokens", type=int, default=2048, help="prompt tokens of one prefill (default 2048)"
    )
    p.add_argument("--batch", type=int, default=1, help="sequences in a decode step (default 1)")
    p.add_argument(
        "--context", type=int, default=2048, help="tokens each decoding sequence holds (default 2048)"
    )
    p.add_argument(
        "--mem-util", type=float, default=0.9, help="fraction of GPU memory to use, in (0, 1] (default 0.9)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class Profile:
    """What `tierserve profile` prints; `--json` prints these fields by name."""

    model: str
    gpu: str
    tp: int
    prefill_tokens: int
    prefill_s: float
    prefill_roofline_s: float
    batch: int
    context: int
    decode_step_s: float
    decode_roofline_s: float
    decode_tokens_per_s: float
    kv_bytes_per_token: int
    kv_bytes_per_token_per_gpu: int
    weight_bytes_per_gpu: int
    mem_util: float
    kv_capacity_tokens: int

    def text(self) -> str:
        ms = 1e3
        return "\n".join(
            [
                f"{self.model} on {self.tp} x {self.gpu}",
                f"  prefill of {self.prefill_tokens} tokens: {ms * self.prefill_s:.2f} ms"
                f" (roofline {ms * self.prefill_roofline_s:.2f} ms)",
                f"  decode step, batch {self.batch}, context {self.context}: {ms * self.decode_step_s:.2f} ms"
                f" (roofline {ms * self.decode_roofline_s:.2f} ms; {self.decode_tokens_per_s:.0f} tokens/s)",
                f"  K/V bytes per token: {self.kv_bytes_per_token:,}{self._split()}",
                f"  K/V capacity at {_percent(self.mem_util)} of memory: {self.kv_capacity_tokens:,} tokens",
            ]
        )

    def _split(self) -> str:
        """How the K/V bytes lie on the GPUs; past one GPU per KV head each GPU holds a copy of
        a head, and the model's own figure is less than the total."""
        if self.tp == 1:
            return ""
        heads = get_model(self.model).num_key_value_heads
        copied = f"; its {heads} KV heads are copied to reach {self.tp} GPUs" if self.tp > heads else ""
        return f" on the {self.tp} GPUs ({self.kv_bytes_per_token_per_gpu:,} per GPU{copied})"


def _percent(share: float) -> str:
    return f"{100 * share:.4g}%"


def profile(
    model_name: str,
    gpu_name: str,
    tp: int = 1,
    prefill_tokens: int = 2048,
    batch: int = 1,
    context: int = 2048,
    mem_util: float = 0.9,
) -> Profile:
    """The figures `tierserve profile` prints; ValueError for unknown names or bad shapes."""
    for name, value in (("tp", tp), ("prefill-tokens", prefill_tokens), ("batch", batch)):
        if value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    if context < 0:
        raise ValueError(f"--context must be >= 0, got {context}")
    for name, value in (("prefill-tokens", prefill_tokens), ("batch", batch), ("context", context)):
        if value > MAX_SHAPE:
            raise ValueError(f"--{name} must be <= {MAX_SHAPE:,}, got {value:,}")
    if batch * (context + 1) > MAX_SHAPE:
        raise ValueError(
            f"--batch x --context must be <= {MAX_SHAPE:,} tokens, got {batch * (context + 1):,}"
        )
    if not 0 < mem_util <= 1:
        raise ValueError(f"--mem-util must be in (0, 1], got {mem_util:g}")
    cm = CostModel(get_gpu(gpu_name), get_model(model_name), tp)
    prefill = cm.step_cost([SeqChunk(prefill_tokens, 0)])
    decode = cm.decode_step_cost(batch, batch * context)
    return Profile(
        model=cm.model.name,
        gpu=cm.gpu.name,
        tp=tp,
        prefill_tokens=prefill_tokens,
        prefill_s=prefill.total_s,
        prefill_roofline_s=prefill.roofline_s,
        batch=batch,
        context=context,
        decode_step_s=decode.total_s,
        decode_roofline_s=decode.roofline_s,
        decode_tokens_per_s=batch / decode.total_s,
        kv_bytes_per_token=cm.kv_bytes_per_token,
        kv_bytes_per_token_per_gpu=cm.kv_bytes_per_token_per_gpu,
        weight_bytes_per_gpu=cm.weight_bytes_per_gpu,
        mem_util=mem_util,
        kv_capacity_tokens=cm.kv_capacity_tokens(mem_util),
    )


def does_not_fit(figures: Profile) -> str | None:
    """Why the model does not fit (its weights leave no K/V room), or None when it fits."""
    if figures.kv_capacity_tokens > 0:
        return None
    usable = figures.mem_util * get_gpu(figures.gpu).memory_bytes
    fitting = [tp for tp in _TP_TRIED if tp > figures.tp and _fits(figures, tp)]
    hint = f"try --tp {fitting[0]}" if fitting else "no --tp up to 64 fits"
    return (
        f"{figures.model} does not fit on {figures.tp} x {figures.gpu}: its weights take "
        f"{figures.weight_bytes_per_gpu / _GIB:.1f} GiB per GPU, {_percent(figures.mem_util)} of one GPU's "
        f"memory is {usable / _GIB:.1f} GiB (2 GiB of it kept for activations), so no K/V cache is left; "
        f"{hint}"
    )


def beyond_limits(figures: Profile) -> list[str]:
    """Shapes the engine would never run, each in a line: the figures are still the cost
    model's, but for a step no deployment of this model takes."""
    context = get_model(figures.model).max_position_embeddings
    notes = []
    for what, tokens in (("a prefill", figures.prefill_tokens), ("a context", figures.context + 1)):
        if tokens > context:
            notes.append(f"{what} of {tokens:,} tokens exceeds the model's context ({context:,})")
    if figures.prefill_tokens > figures.kv_capacity_tokens:
        notes.append(
            f"a prefill of {figures.prefill_tokens:,} tokens holds that many tokens of K/V, over the "
            f"{figures.kv_capacity_tokens:,} that fit"
        )
    held = figures.batch * (figures.context + 1)
    if held > figures.kv_capacity_tokens:
        notes.append(
            f"a decode step of {figures.batch:,} x {figures.context + 1:,} tokens holds {held:,} tokens "
            f"of K/V, over the {figures.kv_capacity_tokens:,} that fit"
        )
    return notes


def caveats(figures: Profile) -> list[str]:
    """What the cost model leaves out for this setup, each in a line: unlike `beyond_limits`, an
    engine may well run it, but the figures flatter it."""
    out = []
    context = get_model(figures.model).max_position_embeddings
    if 0 < figures.kv_capacity_tokens < context:
        # It "fits", yet no request at the model's full context does (Qwen2.5-72B on 2 x H100).
        out.append(
            f"the K/V cache holds {figures.kv_capacity_tokens:,} tokens, fewer than one request at the "
            f"model's context ({context:,}): vLLM refuses to start unless --max-model-len is at most that, "
            "and `tierserve serve --backend sim` serves that much context"
        )
    if figures.tp > _GPUS_PER_NODE:
        nodes = -(-figures.tp // _GPUS_PER_NODE)
        out.append(
            f"--tp {figures.tp} spans {nodes} nodes of {_GPUS_PER_NODE} GPUs, but the all-reduces are "
            "modelled over one node's NVLink (no network between nodes): the times are optimistic"
        )
    return out


def _fits(figures: Profile, tp: int) -> bool:
    try:
        cm = CostModel(get_gpu(figures.gpu), get_model(figures.model), tp)
    except ValueError:  # tp does not divide the model's heads
        return False
    return cm.kv_capacity_tokens(figures.mem_util, DEFAULT_ACTIVATION_RESERVE_BYTES) > 0


def run(args: argparse.Namespace) -> int:
    try:
        figures = profile(
            args.model, args.gpu, args.tp, args.prefill_tokens, args.batch, args.context, args.mem_util
        )
    except ValueError as err:
        print(f"tierserve profile: {err}", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    reason = does_not_fit(figures)
    if reason is not None:
        if args.json:  # a JSON reader gets the verdict on stdout too
            print(json.dumps({"fits": False, "reason": reason} | dataclasses.asdict(figures), indent=2))
        print(f"tierserve profile: {reason}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    notes = beyond_limits(figures)
    if args.json:
        verdict = {"fits": True, "beyond_limits": notes, "caveats": caveats(figures)}
        print(json.dumps(verdict | dataclasses.asdict(figures), indent=2))
        return 0
    print(figures.text())
    for note in notes:
        print(f"  note: {note}; no engine runs such a step")
    for caveat in caveats(figures):
        print(f"  note: {caveat}")
    return 0
