"""`tierserve serve --backend torch --model DIR` on a checkpoint the test writes, with a chat
template: the engine process hands its tokenizer to the HTTP server, and the answers are
transformers' greedy tokens."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import openai
import pytest
import torch
from torch_checkpoints import EOS_ID, VOCAB_SIZE, Checkpoint, add_tokens_past_the_vocabulary, write_checkpoint

from tests.server.helpers import free_socket, wait_until_ready
from tierserve.executors.pytorch.loader import load_model

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    ckpt = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama")
    add_tokens_past_the_vocabulary(ckpt.path)  # ordinary text encodes as before
    return ckpt


@pytest.fixture(scope="module")
def server(checkpoint: Checkpoint) -> Iterator[str]:
    with free_socket() as sock:
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--backend", "torch"]
    cmd += ["--model", str(checkpoint.path), "--port", str(port)]
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        wait_until_ready(proc, url, deadline)
        yield url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _expected(checkpoint: Checkpoint, prompt: list[int]) -> list[int]:
    tokens = checkpoint.greedy(prompt, MAX_TOKENS)
    return tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def test_a_templated_checkpoint_serves_chat_with_transformers_greedy_tokens(
    checkpoint: Checkpoint, server: str
) -> None:
    tok = load_model(checkpoint.path, torch.device("cpu")).tokenizer
    messages = [{"role": "user", "content": "hello world"}]
    expected = _expected(checkpoint, tok.apply_chat_template(messages))
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny-llama"]
    r = client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,  # type: ignore[arg-type]
    )
    assert r.choices[0].message.content == tok.decode(expected)
    assert r.usage is not None and r.usage.completion_tokens == len(expected)
    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == tok.decode(expected)


def test_tools_and_the_tool_fields_of_messages_reach_the_served_template(
    checkpoint: Checkpoint, server: str
) -> None:
    """`tools` (with tool_choice "none") and a message's `name`, `tool_calls` and `tool_call_id`
    were dropped before the template: the model saw another prompt than under vLLM."""
    transformers = pytest.importorskip("transformers")
    tok = load_model(checkpoint.path, torch.device("cpu")).tokenizer
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    arguments = '{"city": "Paris"}'  # OpenAI's JSON string; templates take an object
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "weather in Paris?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Sunny.", "tool_calls": []},  # a plain reply, as vLLM reads it
    ]
    # As vLLM renders it: transformers' template, no content as "", the arguments an object,
    # an empty list of calls none.
    reference = transformers.AutoTokenizer.from_pretrained(checkpoint.path)
    parsed = {**call, "function": {**call["function"], "arguments": {"city": "Paris"}}}
    rendered = [
        {k: v for k, v in m.items() if k != "tool_calls" or v} | {"content": m["content"] or ""}
        for m in messages
    ]
    rendered[1]["tool_calls"] = [parsed]
    text = reference.apply_chat_template(rendered, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "<|tools|>get_weather;" in text and "[ann]" in text
    assert '[calls:get_weather{"city": "Paris"}]' in text and "Sunny.<" in text
    assert "[id:call_1]" in text
    prompt = reference(text, add_special_tokens=False).input_ids
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(
        model="tiny-llama",
        messages=messages,  # type: ignore[arg-type]
        tools=tools,  # type: ignore[arg-type]
        tool_choice="none",
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert r.usage is not None and r.usage.prompt_tokens == len(prompt)
    assert r.choices[0].message.content == tok.decode(_expected(checkpoint, prompt))


def test_completions_take_text_and_token_ids(checkpoint: Checkpoint, server: str) -> None:
    tok = load_model(checkpoint.path, torch.device("cpu")).tokenizer
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    for prompt in ("the quick brown fox", tok.encode("jumps over")):
        ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
        expected = _expected(checkpoint, ids)
        r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == tok.decode(ids + expected)[len(tok.decode(ids)) :]


def test_a_token_past_the_models_vocabulary_is_a_400_naming_the_field(server: str) -> None:
    """It reached the embeddings and crashed the engine step, aborting every request in it."""
    past = f"<x{VOCAB_SIZE - 300}>"
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model="tiny-llama", prompt=f"hello {past}", max_tokens=4)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": past}], max_tokens=4
        )
    assert completion.value.body["param"] == "prompt" and "past the model's vocabulary" in str(
        completion.value
    )
    assert chat.value.body["param"] == "messages"
    assert client.completions.create(
        model="tiny-llama", prompt="hello", max_tokens=2
    ).choices  # still serving


def test_chat_template_kwargs_reach_the_served_template(checkpoint: Checkpoint, server: str) -> None:
    """Qwen3's `chat_template_kwargs: {"enable_thinking": false}`, which clients send to vLLM,
    was a 400: the template's variables now come from the request."""
    tok = load_model(checkpoint.path, torch.device("cpu")).tokenizer
    messages = [{"role": "user", "content": "hello world"}]
    variables = {"enable_thinking": False}
    prompt = tok.apply_chat_template(messages, variables)
    assert prompt != tok.apply_chat_template(messages)  # the template reads it
    expected = _expected(checkpoint, prompt)
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(
        model="tiny-llama",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"chat_template_kwargs": variables},
    )
    assert r.choices[0].message.content == tok.decode(expected)
    assert r.usage is not None and r.usage.prompt_tokens == len(prompt)
    for bad in ({"messages": []}, ["enable_thinking"]):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="tiny-llama",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=2,
                extra_body={"chat_template_kwargs": bad},
            )
        assert e.value.body["param"] == "chat_template_kwargs", e.value.body  # type: ignore[index]
