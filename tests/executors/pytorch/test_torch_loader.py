"""Loading local Hugging Face directories: what loads, and the error each broken file gives."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch_checkpoints import (
    BOS_ID,
    EOS_ID,
    VOCAB_SIZE,
    Checkpoint,
    add_tokens_past_the_vocabulary,
    edit_json,
)
from torch_paged_runner import prompt_logits

from tierserve.executors.pytorch.executor import build_torch_executor
from tierserve.executors.pytorch.hf_config import ModelLoadError
from tierserve.executors.pytorch.loader import load_model, make_demo_model, make_random_model
from tierserve.executors.pytorch.model import CausalLM
from tierserve.executors.pytorch.tokenizer import ByteTokenizer, HFTokenizer
from tierserve.model_config import DEMO_MODEL
from tierserve.request import SamplingDefaults

CPU = torch.device("cpu")


def load_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(path, CPU)
    return str(info.value)


def test_sharded_checkpoint_loads_the_same_weights(make_checkpoint) -> None:
    ckpt: Checkpoint = make_checkpoint(max_shard_size="60KB")
    assert (ckpt.path / "model.safetensors.index.json").exists()
    assert len(list(ckpt.path.glob("*.safetensors"))) > 1
    executor, _ = build_torch_executor(ckpt.path, dtype=torch.float64, num_device_blocks=8)
    prompt = [5, 9, 200, 31, 7]
    torch.testing.assert_close(prompt_logits(executor, prompt), ckpt.logits(prompt), atol=1e-9, rtol=1e-9)


def test_tokenizer_eos_bos_and_chat_template(checkpoint: Checkpoint) -> None:
    tok = load_model(checkpoint.path, CPU).tokenizer
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_token_ids == (EOS_ID,)
    ids = tok.encode("hello world")
    assert ids[0] == BOS_ID and tok.decode(ids) == "hello world"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.count(BOS_ID) == 1 and chat[0] == BOS_ID  # the template's BOS, not a second one
    assert tok.decode(chat) == "<|user|>hi<|assistant|>"  # </s> is special: skipped on decode


def test_a_template_renders_only_the_bos_and_eos_the_tokenizer_declares(checkpoint: Checkpoint) -> None:
    """As transformers' apply_chat_template: none declared, they are empty. They were filled
    from config.json's ids, and --chat built other prompt ids than transformers."""
    config_path = checkpoint.path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["bos_token"], config["eos_token"]
    config_path.write_text(json.dumps(config))
    tok = load_model(checkpoint.path, CPU).tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert BOS_ID not in chat and EOS_ID not in chat
    assert tok.eos_token_ids == (EOS_ID,)  # stopping still knows the end of text, from config.json
    # A special_tokens_map.json (older checkpoints') declares them as tokenizer_config.json would.
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    (checkpoint.path / "special_tokens_map.json").write_text(json.dumps(special))
    chat = load_model(checkpoint.path, CPU).tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat[0] == BOS_ID and EOS_ID in chat
    # ... unless tokenizer_config.json lists its added tokens: then transformers 5 reads no map.
    edit_json(config_path, added_tokens_decoder={})
    chat = load_model(checkpoint.path, CPU).tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert BOS_ID not in chat and EOS_ID not in chat


def test_chat_template_kwargs_reach_the_template_and_may_not_set_what_the_server_does(
    checkpoint: Checkpoint,
) -> None:
    """vLLM's `chat_template_kwargs` (Qwen3's `enable_thinking`, say) were refused; they are
    variables of the template's, beside the ones every template gets."""
    tok = load_model(checkpoint.path, CPU).tokenizer
    hi = [{"role": "user", "content": "hi"}]
    assert (
        tok.decode(tok.apply_chat_template(hi, {"enable_thinking": False})) == "<|user|>hi<|assistant|>Done!"
    )
    assert tok.apply_chat_template(hi, {"enable_thinking": True}) == tok.apply_chat_template(hi)
    with pytest.raises(
        ValueError, match="chat_template_kwargs: add_generation_prompt, messages: set by the server"
    ):
        tok.apply_chat_template(hi, {"messages": [], "add_generation_prompt": False})
    edit_json(checkpoint.path / "tokenizer_config.json", chat_template=None)
    plain = load_model(checkpoint.path, CPU).tokenizer
    with pytest.raises(ValueError, match="no chat template to give enable_thinking to"):
        plain.apply_chat_template(hi, {"enable_thinking": False})
    assert plain.apply_chat_template(hi, {}) == plain.apply_chat_template(hi)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TOOL_CHAT = [
    {"role": "user", "content": "weather in Paris?", "name": "ann"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {}}}
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]


def test_tools_and_the_tool_fields_of_messages_reach_the_template(checkpoint: Checkpoint) -> None:
    """vLLM gives the template the request's `tools` and the messages' `name`, `tool_calls`
    and `tool_call_id`; a model without a template keeps its plain lines."""
    tok = load_model(checkpoint.path, CPU).tokenizer
    assert tok.decode(tok.apply_chat_template(TOOL_CHAT, tools=TOOLS)) == (
        "<|tools|>get_weather;<|user|>[ann]weather in Paris?<|assistant|>[calls:get_weather{}]"
        "<|tool|>sunny[id:call_1]<|assistant|>"
    )
    with pytest.raises(
        ValueError, match=r"chat_template_kwargs: tools: set by the server.*request's `tools`"
    ):
        tok.apply_chat_template(TOOL_CHAT, {"tools": TOOLS})
    edit_json(checkpoint.path / "tokenizer_config.json", chat_template=None)
    plain = load_model(checkpoint.path, CPU).tokenizer
    bare = [{"role": m["role"], "content": m["content"]} for m in TOOL_CHAT]
    assert plain.apply_chat_template(TOOL_CHAT, tools=TOOLS) == plain.apply_chat_template(bare)
    demo = ByteTokenizer()
    assert demo.apply_chat_template(TOOL_CHAT, tools=TOOLS) == demo.apply_chat_template(bare)


def test_generation_config_eos_ids_win_over_config_json(checkpoint: Checkpoint) -> None:
    (checkpoint.path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    executor, tok = build_torch_executor(checkpoint.path, num_device_blocks=4)
    assert tok.eos_token_ids == (1, 7)
    assert executor.spec.eos_token_ids == (1, 7)


def test_generation_config_sampling_settings_become_the_models_defaults(
    checkpoint: Checkpoint, caplog: pytest.LogCaptureFixture
) -> None:
    """Qwen2.5-Instruct's file, say: vLLM takes these for what a request leaves out, and
    transformers' generate() applies the repetition penalty even when greedy."""
    settings = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    more = {"presence_penalty": 0.5, "min_p": 0.05}
    (checkpoint.path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, **settings, **more})
    )
    executor, _ = build_torch_executor(checkpoint.path, num_device_blocks=4)
    expected = SamplingDefaults(
        temperature=0.7, top_p=0.8, top_k=20, presence_penalty=0.5, repetition_penalty=1.05
    )
    assert executor.spec.sampling_defaults == expected
    assert (
        executor.spec.sampling_defaults.said()
        == "temperature: 0.7, top_p: 0.8, top_k: 20, presence_penalty: 0.5, repetition_penalty: 1.05"
    )
    assert "min_p 0.05 not applied (vLLM applies them)" in caplog.text
    (checkpoint.path / "generation_config.json").write_text(json.dumps({"top_k": -1, "temperature": None}))
    assert build_torch_executor(checkpoint.path, num_device_blocks=4)[
        0
    ].spec.sampling_defaults == SamplingDefaults(
        top_k=0  # vLLM's "off"; null is absent
    )


def test_generate_applies_the_models_repetition_penalty_as_transformers_does(checkpoint: Checkpoint) -> None:
    """transformers' greedy generate() applies generation_config.json's repetition penalty;
    `tierserve generate` did not, and its tokens parted from transformers' on such models."""
    from tierserve.generate import generate

    prompt = "the same words and the same words"
    plain = generate(
        *build_torch_executor(checkpoint.path, num_device_blocks=8), prompt, max_tokens=16, ignore_eos=True
    )
    # Below 1 it favours what was said: a random model's output changes for sure.
    (checkpoint.path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 0.2}))
    executor, tokenizer = build_torch_executor(checkpoint.path, num_device_blocks=8)
    penalised = generate(executor, tokenizer, prompt, max_tokens=16, ignore_eos=True)
    ids = penalised.prompt_token_ids
    assert penalised.token_ids == checkpoint.greedy(ids, 16, repetition_penalty=0.2) != plain.token_ids
    asked = generate(executor, tokenizer, prompt, max_tokens=16, ignore_eos=True, repetition_penalty=1.0)
    assert asked.token_ids == checkpoint.greedy(ids, 16)  # the flag wins over the file


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_k": 2.5}, "top_k: expected an integer, got 2.5"),
        ({"top_k": -5}, "top_k must be >= 0, got -5"),  # -1 is vLLM's "off"; below it, nothing
        ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2]"),
        ({"temperature": "0.7"}, "temperature: expected a number, got '0.7'"),
        ({"repetition_penalty": True}, "repetition_penalty: expected a number, got True"),
    ],
)
def test_a_sampling_setting_no_request_could_give_is_refused_naming_the_file(
    checkpoint: Checkpoint, settings: dict[str, object], said: str
) -> None:
    (checkpoint.path / "generation_config.json").write_text(json.dumps(settings))
    with pytest.raises(ModelLoadError) as info:
        load_model(checkpoint.path, CPU)
    assert str(info.value).startswith(f"{checkpoint.path / 'generation_config.json'}: ")
    assert said in str(info.value)


def test_without_chat_template_a_plain_format_is_used(checkpoint: Checkpoint) -> None:
    edit_json(checkpoint.path / "tokenizer_config.json", chat_template=None)
    tok = load_model(checkpoint.path, CPU).tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "user: hi\nassistant:"


def test_unsupported_architecture_is_rejected(checkpoint: Checkpoint) -> None:
    edit_json(checkpoint.path / "config.json", architectures=["GPT2LMHeadModel"])
    message = load_error(checkpoint.path)
    assert "config.json" in message and "GPT2LMHeadModel" in message and "unsupported" in message


def test_unsupported_rope_type_is_rejected(checkpoint: Checkpoint) -> None:
    edit_json(checkpoint.path / "config.json", rope_parameters={"rope_type": "yarn", "factor": 2.0})
    assert "yarn" in load_error(checkpoint.path)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file_is_named(checkpoint: Checkpoint, name: str) -> None:
    (checkpoint.path / name).unlink()
    message = load_error(checkpoint.path)
    assert "missing file" in message
    assert name in message or "safetensors" in message


def test_missing_shard_listed_in_the_index_is_named(make_checkpoint) -> None:
    ckpt: Checkpoint = make_checkpoint(max_shard_size="60KB")
    shard = sorted(ckpt.path.glob("*.safetensors"))[-1]
    shard.unlink()
    message = load_error(ckpt.path)
    assert shard.name in message and "missing file" in message


def test_malformed_json_is_named(checkpoint: Checkpoint) -> None:
    (checkpoint.path / "config.json").write_text('{"hidden_size": 64,')
    message = load_error(checkpoint.path)
    assert "config.json" in message and "malformed JSON" in message


def test_missing_config_field_is_named(checkpoint: Checkpoint) -> None:
    edit_json(checkpoint.path / "config.json", hidden_size=None)
    message = load_error(checkpoint.path)
    assert "config.json" in message and "hidden_size" in message


def test_missing_tensor_is_named(checkpoint: Checkpoint) -> None:
    edit_json(checkpoint.path / "config.json", num_hidden_layers=3)  # layer 2 is not in the file
    message = load_error(checkpoint.path)
    assert "model.layers.2." in message and "not found" in message and "model.safetensors" in message


def test_tensor_shape_not_matching_config_is_named(checkpoint: Checkpoint) -> None:
    edit_json(checkpoint.path / "config.json", intermediate_size=100)
    message = load_error(checkpoint.path)
    assert (
        "model.safetensors" in message
        and "mlp" in message
        and "(128, 64)" in message
        and "(100, 64)" in message
    )


def test_tied_config_with_a_different_lm_head_in_the_weights_is_refused(checkpoint: Checkpoint) -> None:
    # transformers 5 leaves such a head untied and uses it; we used the embeddings silently,
    # so greedy outputs differed from transformers' (bench engine: 0 of 32 identical).
    edit_json(checkpoint.path / "config.json", tie_word_embeddings=True)
    message = load_error(checkpoint.path)
    assert "model.safetensors" in message and "'lm_head.weight' differs" in message
    assert "tie_word_embeddings" in message


def test_tied_config_with_an_lm_head_equal_to_the_embeddings_loads(checkpoint: Checkpoint) -> None:
    from safetensors.torch import load_file, save_file

    weights = checkpoint.path / "model.safetensors"
    tensors = load_file(weights)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, weights, metadata={"format": "pt"})
    edit_json(checkpoint.path / "config.json", tie_word_embeddings=True)
    model = load_model(checkpoint.path, CPU).model
    assert model.lm_head is None
    assert torch.equal(model.model.embed_tokens.weight, tensors["lm_head.weight"])


def test_not_a_directory_is_rejected(tmp_path: Path) -> None:
    assert "not a directory" in load_error(tmp_path / "nowhere")


def test_demo_model_is_deterministic_and_needs_no_files() -> None:
    a, b = make_demo_model(CPU), make_demo_model(CPU)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
    loaded = load_model("demo", CPU)
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    assert loaded.model.config.name == "demo"


def test_random_model_has_the_configs_shape_and_seeded_weights() -> None:
    config = replace(DEMO_MODEL, name="untied", tie_word_embeddings=False, num_hidden_layers=2)
    a = make_random_model(config, CPU, torch.bfloat16, seed=3)
    b = make_random_model(config, CPU, torch.bfloat16, seed=3)
    c = make_random_model(config, CPU, torch.bfloat16, seed=4)
    tensors = a.checkpoint_tensors()
    assert tensors.keys() == CausalLM(config).checkpoint_tensors().keys()
    assert tensors["lm_head.weight"].shape == (config.vocab_size, config.hidden_size)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert torch.all(tensors["model.layers.1.input_layernorm.weight"] == 1)
    for name, t in tensors.items():
        assert torch.equal(t, b.checkpoint_tensors()[name]), name
        if not name.endswith("norm.weight"):
            assert 0.015 < t.float().std() < 0.025, name
            assert not torch.equal(t, c.checkpoint_tensors()[name]), name


def test_a_half_precision_load_allocates_its_weights_at_their_size(
    checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The model must be in the asked dtype when its storage is first allocated, not be made
    # in float32 and cast (three times a half-precision model's size at the peak).
    allocated: list[torch.dtype] = []
    to_empty = CausalLM.to_empty

    def record(self: CausalLM, *, device: torch.device) -> CausalLM:
        allocated.extend(p.dtype for p in self.parameters())
        return to_empty(self, device=device)

    monkeypatch.setattr(CausalLM, "to_empty", record)
    loaded = load_model(checkpoint.path, CPU, torch.bfloat16)
    assert allocated and set(allocated) == {torch.bfloat16}
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())


def test_on_a_cpu_linear_weights_are_stored_column_major_with_the_checkpoints_values(
    checkpoint: Checkpoint,
) -> None:
    loaded = load_model(checkpoint.path, CPU, torch.float64)
    expected = checkpoint.hf.state_dict()  # the saved weights, in float64
    for name, module in loaded.model.named_modules():
        if isinstance(module, torch.nn.Linear):
            # [out, in] in shape, [in, out] in memory
            assert module.weight.stride() == (1, module.weight.shape[0]), name
    for name, tensor in loaded.model.checkpoint_tensors().items():
        torch.testing.assert_close(tensor, expected[name].to(torch.float64), rtol=0, atol=0, msg=name)


def test_the_tokenizer_crosses_a_process_boundary_with_its_chat_template(checkpoint: Checkpoint) -> None:
    """`serve --backend torch` sends the engine's tokenizer to the HTTP server: a compiled
    chat template does not pickle, so every templated checkpoint failed to start."""
    import pickle

    tok = load_model(checkpoint.path, CPU).tokenizer
    assert isinstance(tok, HFTokenizer) and tok.has_chat_template
    copy = pickle.loads(pickle.dumps(tok))
    chat = [{"role": "user", "content": "hi"}]
    assert copy.apply_chat_template(chat) == tok.apply_chat_template(chat)
    assert copy.encode("hello world") == tok.encode("hello world")


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages[0].content + 1 }}",
        "{{ (messages | selectattr('role', 'eq', 'system') | first).content }}",
    ],
    ids=["type-error", "undefined"],
)
def test_a_template_that_fails_on_the_messages_is_a_value_error(
    checkpoint: Checkpoint, template: str
) -> None:
    """The server answers a ValueError with a 400 naming `messages`; any other error was a 500."""
    edit_json(checkpoint.path / "tokenizer_config.json", chat_template=template)
    tok = load_model(checkpoint.path, CPU).tokenizer
    with pytest.raises(ValueError, match=r"^chat template: (TypeError|UndefinedError): "):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_text_holding_a_token_past_the_models_vocabulary_is_refused(checkpoint: Checkpoint) -> None:
    """A tokenizer with added tokens the embeddings do not cover: encoding one used to crash
    the engine step (and every request in it)."""
    past = add_tokens_past_the_vocabulary(checkpoint.path)
    tok = load_model(checkpoint.path, CPU).tokenizer
    assert tok.encode(f"hello <x{VOCAB_SIZE - 301}>")  # the model's last id still encodes
    with pytest.raises(ValueError, match=rf"'{past}' \(id {VOCAB_SIZE}\), past the model's vocabulary"):
        tok.encode(f"hello {past}")


def test_encoding_a_long_text_lets_other_threads_run(checkpoint: Checkpoint) -> None:
    """The server tokenizes a large body on a thread of its own, but `Tokenizer.encode` held the
    GIL throughout: a 1 MiB prompt froze every token stream for about half a second."""
    tok = load_model(checkpoint.path, CPU).tokenizer
    text = "hello world, " * 60_000
    stamps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        started = time.perf_counter()
        ids = tok.encode(text)
        ended = time.perf_counter()
    finally:
        done.set()
        ticker.join()
    assert ids == list(tok._tok.encode(text).ids)  # the same ids as `encode` gives
    # Stamps well inside the call: none where it holds the GIL (the margins take in a
    # thread switch just before or after it).
    margin = 0.02
    assert ended - started > 4 * margin, "the text encoded too fast to tell"
    assert any(started + margin < t < ended - margin for t in stamps)


def test_generate_says_the_loaders_warnings_as_its_own_lines(
    make_checkpoint: Callable[..., Checkpoint], capsys: pytest.CaptureFixture[str]
) -> None:
    """A sliding window that caps the context was a bare log record among the output."""
    from tierserve.cli import main

    checkpoint = make_checkpoint(arch="mistral")
    edit_json(checkpoint.path / "config.json", sliding_window=64)
    assert main(["generate", "--model", str(checkpoint.path), "--prompt", "hi", "--max-tokens", "2"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "requests are held to" in line]
    assert len(warnings) == 1 and warnings[0].startswith("tierserve generate: warning: "), warnings
