"""`tierserve generate`: run one prompt through the engine on the PyTorch executor.

Importing this module is cheap; torch loads only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierserve.executors.pytorch.executor import TorchExecutor
    from tierserve.executors.pytorch.tokenizer import Tokenizer

_CONTEXT_TOKENS = 4  # prompt tokens the detokenizer sees for context (leading spaces)


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
    from tierserve.engine import Engine
    from tierserve.executors.pytorch.stop import StopStringChecker
    from tierserve.request import Request, SamplingParams

    if chat:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    else:
        prompt_ids = tokenizer.encode(prompt)
    clock = WallClock()
    engine = Engine(EngineConfig(), "hybrid", executor, clock)
    params = SamplingParams(**{"max_tokens": 64, **sampling})
    req = Request("generate-0", prompt_ids, params, arrival_time=clock.now())
    if not engine.add_request(req):
        raise ValueError(f"request rejected: {req.reject_reason}")
    checker = StopStringChecker(tokenizer, stop, context_token_ids=prompt_ids[-_CONTEXT_TOKENS:])
    emit = on_text or (lambda _text: None)
    while engine.has_unfinished():
        for out in engine.step():
            emit(checker.push(out.new_token_ids))
            if checker.stopped and not out.finished:
                engine.finish(req.request_id)
    emit(checker.flush())
    reason = "stop" if checker.stopped else (req.finish_reason.value if req.finish_reason else "")
    return GenerateResult(list(prompt_ids), list(req.output_token_ids), checker.text, reason)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("generate", help="generate text from one prompt with the PyTorch executor")
    p.add_argument(
        "--model", default="demo", help='"demo" (random weights, byte tokenizer) or a local HF directory'
    )
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--presence-penalty", type=float, default=0.0, help="-2..2, as OpenAI's")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="-2..2, as OpenAI's")
    p.add_argument(
        "--stop", nargs="+", default=[], metavar="STR", help="stop strings (not included in the text)"
    )
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--json", action="store_true", help="print prompt_token_ids, token_ids and text as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tierserve.executors.pytorch.executor import build_torch_executor
    from tierserve.executors.pytorch.hf_config import ModelLoadError

    try:
        executor, tokenizer = build_torch_executor(args.model, args.device)
        stream = None if args.json else (lambda text: print(text, end="", flush=True))
        result = generate(
            executor,
            tokenizer,
            args.prompt,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            chat=args.chat,
            on_text=stream,
        )
    except (ModelLoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = asdict(result)
        print(json.dumps({k: out[k] for k in ("prompt_token_ids", "token_ids", "text", "finish_reason")}))
    else:
        print()
    return 0
