"""`tierserve generate`: run one prompt through the engine on the PyTorch executor.

Importing this module is cheap; torch loads only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierserve.cli_args import add_kv_cache_flag, device_name, float_between, kv_cache_bytes, positive_int

if TYPE_CHECKING:
    from tierserve.executors.pytorch.executor import TorchExecutor
    from tierserve.executors.pytorch.tokenizer import Tokenizer

_KEPT_CONTROLS = "\n\t"
DEMO_NOTICE = (
    "the demo model has random weights and a byte-level tokenizer: its text is gibberish by design; "
    "control characters are shown as escapes such as \\x08"
)
# The `SamplingParams` fields set by flags of the same name (`top_p` by `--top-p`).
_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
)


def visible(text: str) -> str:
    """`text` with its control characters (newline and tab aside) written as escapes such as
    `\\x08`, so that a terminal shows them instead of acting on them (a backspace erases)."""
    return "".join(
        ch.encode("unicode_escape").decode("ascii")
        if ch not in _KEPT_CONTROLS and unicodedata.category(ch) == "Cc"
        else ch
        for ch in text
    )


@dataclass(frozen=True)
class GenerateResult:
    prompt_token_ids: list[int]  # exactly what the model was fed, BOS included
    token_ids: list[int]  # generated tokens only
    text: str  # their text, cut before a stop string
    finish_reason: str


def generate(
    executor: TorchExecutor,
    tokenizer: Tokenizer,
    prompt: str,
    *,
    stop: Sequence[str] = (),
    chat: bool = False,
    on_text: Callable[[str], None] | None = None,
    **sampling: Any,
) -> GenerateResult:
    """Generate a reply to `prompt` (a chat user turn when `chat`); `on_text` gets text as it
    is final. `sampling`: `SamplingParams` fields (max_tokens defaults to 64 here)."""
    from tierserve.clock import WallClock
    from tierserve.config import EngineConfig
    from tierserve.detokenize import TextStream
    from tierserve.engine import Engine
    from tierserve.request import Request, SamplingParams

    if chat:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    else:
        prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:  # the Request's own error named its internal id
        raise ValueError("the prompt is empty: it encodes to no tokens, and this model's tokenizer adds none")
    clock = WallClock()
    engine = Engine(EngineConfig(), "hybrid", executor, clock)
    # A repetition penalty from the model's generation_config.json applies, as it does to
    # transformers' generate() (greedy or not); its temperature and top-p/k do not: greedy
    # unless asked, as the flags say.
    model_penalty = executor.spec.sampling_defaults.repetition_penalty
    params = SamplingParams(**{"max_tokens": 64, "repetition_penalty": model_penalty or 1.0, **sampling})
    req = Request("generate-0", prompt_ids, params, arrival_time=clock.now())
    if not engine.add_request(req):
        said = req.reject_reason or ""
        if "the KV cache holds" in said:  # the executor's note: the pool, not the model, is the limit
            said += "; --kv-cache-gib gives the cache more memory"
        raise ValueError(f"request rejected: {said}")
    stream = TextStream(tokenizer, stop, context_token_ids=prompt_ids)
    pieces: list[str] = []

    def emit(text: str) -> None:
        if text:
            pieces.append(text)
            if on_text is not None:
                on_text(text)

    while engine.has_unfinished():
        for out in engine.step():
            emit(stream.push(out.new_token_ids))
            if stream.stopped and not out.finished:
                engine.finish(req.request_id)
    emit(stream.flush())
    reason = "stop" if stream.stopped else (req.finish_reason.value if req.finish_reason else "")
    return GenerateResult(list(prompt_ids), list(req.output_token_ids), "".join(pieces), reason)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "generate",
        help="generate text from one prompt with the PyTorch executor",
        description="Run one prompt through tierserve's engine on a real PyTorch model and print the "
        "text as it comes. The built-in 'demo' model has random weights and a byte-level tokenizer, "
        "so its text is gibberish: it shows that the engine runs, not what a model says. Control "
        "characters in the text are printed as escapes such as \\x08.",
    )
    p.add_argument(
        "--model",
        default="demo",
        help="'demo' (random weights made at start-up, nothing downloaded) or a local Hugging Face model "
        "directory with config.json, *.safetensors and tokenizer.json (default: demo)",
    )
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument(
        "--max-tokens", type=positive_int, default=64, help="tokens to generate at most (default: 64)"
    )
    p.add_argument(
        "--temperature",
        type=float_between(0.0, 2.0),
        default=0.0,
        help="sampling temperature, 0..2 as in OpenAI's API and the server's; 0 = greedy (default: 0)",
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling: probability mass kept (default: 1)"
    )
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens; 0 = all (default: 0)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling, for a repeatable run")
    p.add_argument(
        "--presence-penalty", type=float, default=0.0, help="-2..2, as in OpenAI's API (default: 0)"
    )
    p.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="-2..2, as in OpenAI's API (default: 0)"
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="divides the logits of the tokens already in the prompt or output (multiplies negative "
        "ones), as in transformers and vLLM; 1 = off (default: the model's generation_config.json, else 1)",
    )
    p.add_argument(
        "--stop", nargs="+", default=[], metavar="STR", help="stop strings (not included in the text)"
    )
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--device", type=device_name, default="cpu", help="cpu or cuda (default: cpu)")
    add_kv_cache_flag(p)
    p.add_argument(
        "--json",
        action="store_true",
        help="print prompt_token_ids, token_ids, text and finish_reason as one JSON object",
    )
    p.set_defaults(func=run)


def sampling_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags as `SamplingParams` fields, checked before any model is built: a bad
    value is a ValueError that names its flag, as is a --max-tokens that leaves no room for a
    prompt in the model's context."""
    from tierserve.request import SamplingParams

    sampling = {field: getattr(args, field) for field in _SAMPLING_FIELDS}
    if sampling["repetition_penalty"] is None:  # the model's, once it is loaded
        del sampling["repetition_penalty"]
    try:
        SamplingParams(**sampling)
    except ValueError as e:
        raise ValueError(_said_as_flag(str(e), sampling)) from None
    limit = _context_limit(args.model)
    if limit is not None and args.max_tokens >= limit[0]:
        raise ValueError(
            f"--max-tokens must be below {limit[1]}, got {args.max_tokens}: "
            "the prompt takes at least one token"
        )
    return sampling


def _said_as_flag(message: str, sampling: dict[str, Any]) -> str:
    """`SamplingParams`' message ("top_p must be ..., got 0.0") said as the flag's, with the
    value as typed ("--top-p must be ..., got 0")."""
    field, _, rest = message.partition(" ")
    if field not in _SAMPLING_FIELDS:
        return message
    flag = "--" + field.replace("_", "-")
    rule, got, _ = rest.rpartition(", got ")
    value = sampling[field]
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{flag} {rule}, got {shown}" if got else f"{flag} {rest}"


def _context_limit(model: str) -> tuple[int, str] | None:
    """The model's context in tokens and how to say it, read without loading the model; None
    where the directory has no config.json (loading it then says what is wrong)."""
    if model == "demo":
        from tierserve.model_config import DEMO_MODEL

        limit = DEMO_MODEL.max_position_embeddings
        return limit, f"the model's context of {limit} tokens"
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    from tierserve.executors.pytorch.hf_config import parse_hf_config

    spec = parse_hf_config(config)
    return spec.max_model_len, spec.context_said()


def run(args: argparse.Namespace) -> int:
    from tierserve.executors.pytorch.hf_config import ModelLoadError

    # Said once the request is accepted, so that a refused one is the only line on stderr.
    notices = [f"note: {DEMO_NOTICE}"] if args.model == "demo" and not args.json else []

    def stream(text: str) -> None:
        while notices:
            print(notices.pop(), file=sys.stderr, flush=True)
        print(visible(text), end="", flush=True)

    # The loader's warnings (a sliding window that caps the context, say) as lines of this
    # command's own, not bare log records among the output.
    warning_lines = logging.StreamHandler(sys.stderr)
    warning_lines.setFormatter(logging.Formatter("tierserve generate: warning: %(message)s"))
    warning_lines.setLevel(logging.WARNING)
    logging.getLogger("tierserve").addHandler(warning_lines)
    try:
        sampling = sampling_from_args(args)
        from tierserve.executors.pytorch.executor import build_torch_executor

        executor, tokenizer = build_torch_executor(
            args.model, args.device, kv_cache_bytes=kv_cache_bytes(args)
        )
        result = generate(
            executor,
            tokenizer,
            args.prompt,
            stop=args.stop,
            chat=args.chat,
            on_text=None if args.json else stream,
            **sampling,
        )
    except (ModelLoadError, ValueError) as e:
        print(f"tierserve generate: {e}", file=sys.stderr)
        return 2
    finally:
        logging.getLogger("tierserve").removeHandler(warning_lines)
    if args.json:
        out = asdict(result)
        print(json.dumps({k: out[k] for k in ("prompt_token_ids", "token_ids", "text", "finish_reason")}))
    else:
        print()
    return 0
