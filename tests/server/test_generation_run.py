"""How a generation's deltas become text, a finish reason and usage (GenerationRun)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tests.conftest import make_request
from tests.server.helpers import ByteTokenizer
from tierserve.request import FinishReason, SamplingParams
from tierserve.server.generate import GenerationRun
from tierserve.server.prepare import Prepared
from tierserve.server.streams import Delta, RequestHandle


def _run(stop: tuple[str, ...]) -> tuple[GenerationRun, list[str]]:
    finished: list[str] = []
    engine = SimpleNamespace(finish=finished.append)
    metrics = SimpleNamespace(count_generated=lambda n: None)
    state: Any = SimpleNamespace(tokenizer=ByteTokenizer(), engine=engine, metrics=metrics)
    prompt = ByteTokenizer().encode("a prompt")
    prepared = Prepared(prompt, SamplingParams(max_tokens=8), stop, stream=False, include_usage=False)
    handle = RequestHandle(make_request(num_prompt=len(prompt), max_tokens=8))
    return GenerationRun(state, handle, None, prepared, None), finished  # type: ignore[arg-type]


def test_a_stop_string_that_completes_only_at_the_final_flush_ends_with_stop() -> None:
    """Bytes of an unfinished character are held back until the end, where they decode to
    U+FFFD; a stop string completed by it cut the text but the reason said "length"."""
    run, _ = _run(("b\ufffd",))
    text, reason, _ = run._consume([Delta((97, 98, 0xD3)), Delta((), True, FinishReason.LENGTH)])
    assert (text, reason) == ("a", "stop")
    run, _ = _run(("zz",))
    text, reason, _ = run._consume([Delta((97, 98, 0xD3)), Delta((), True, FinishReason.LENGTH)])
    assert (text, reason) == ("ab\ufffd", "length")


def test_the_cached_prompt_tokens_come_with_the_first_tokens_when_a_stop_string_ends_it() -> None:
    """The cached count came only with the final delta, which a request ended by a stop
    string never reads: its usage said 0 cached tokens."""
    run, finished = _run(("c",))
    text, reason, _ = run._consume([Delta((97,), num_cached_tokens=48)])
    assert (text, reason) == ("a", None)
    text, reason, _ = run._consume([Delta((98, 99))])
    assert (text, reason) == ("b", "stop") and finished
    assert run._usage.cached_tokens == 48
