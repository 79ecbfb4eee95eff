"""Checkpoints as users bring them: damaged or foreign weight files, SentencePiece-only tokenizers,
chat templates that use transformers' Jinja extras, and config.json values written as null."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch_checkpoints import Checkpoint

from tierserve.executors.pytorch.hf_config import ModelLoadError
from tierserve.executors.pytorch.loader import load_model
from tierserve.executors.pytorch.tokenizer import HFTokenizer

CPU = torch.device("cpu")

# Every extra that transformers' apply_chat_template gives a template: {% break %}, the
# {% generation %} block (with a `set` inside, which must not leak out), transformers' tojson
# (no HTML escaping, non-ASCII kept, json.dumps options) and strftime_now.
EXTRAS_TEMPLATE = (
    "{% set seen = 'outer' %}"
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{% set seen = 'inner' %}{{ m['content'] }}"
    "{% endgeneration %}{% else %}<{{ m['role'] }}>{{ m['content'] | tojson }}{% endif %}{% endfor %}"
    "{{ seen }}{{ {'b': '<i>&ü', 'a': 1} | tojson(indent=2, sort_keys=true) }}"
    "[{{ strftime_now('%Y') | length }}]"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [
    {"role": "user", "content": "hi <x> ü"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "never rendered: the loop breaks first"},
]


def load_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(path, CPU)
    return str(info.value)


def set_template(ckpt: Checkpoint, template: str) -> None:
    path = ckpt.path / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config))


def test_a_truncated_safetensors_file_is_a_load_error_naming_it(checkpoint: Checkpoint) -> None:
    weights = checkpoint.path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:3000])
    message = load_error(checkpoint.path)
    assert "model.safetensors" in message and "unreadable safetensors" in message


def test_a_garbage_shard_listed_in_the_index_is_a_load_error_naming_it(make_checkpoint) -> None:
    ckpt: Checkpoint = make_checkpoint(max_shard_size="60KB")
    shard = sorted(ckpt.path.glob("*.safetensors"))[0]
    shard.write_bytes(b"not a safetensors file at all")
    message = load_error(ckpt.path)
    assert shard.name in message and "unreadable safetensors" in message


def test_pytorch_bin_weights_are_named_when_no_safetensors_exist(checkpoint: Checkpoint) -> None:
    weights = checkpoint.path / "model.safetensors"
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, checkpoint.path / "pytorch_model.bin")
    weights.unlink()
    message = load_error(checkpoint.path)
    assert "missing file" in message and "pytorch_model.bin" in message and "safetensors" in message


def test_a_sentencepiece_model_without_tokenizer_json_is_named(checkpoint: Checkpoint) -> None:
    (checkpoint.path / "tokenizer.json").unlink()
    (checkpoint.path / "tokenizer.model").write_bytes(b"\x00")
    message = load_error(checkpoint.path)
    assert "tokenizer.json: missing file" in message and "tokenizer.model" in message


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
def test_a_chat_template_that_does_not_compile_is_a_load_error_naming_its_file(
    checkpoint: Checkpoint, where: str
) -> None:
    broken = "{% for m in messages %}{{ m['content'] }"
    if where == "chat_template.jinja":
        set_template(checkpoint, "")
        (checkpoint.path / where).write_text(broken)
    else:
        set_template(checkpoint, broken)
    message = load_error(checkpoint.path)
    assert where in message and "chat_template" in message and "TemplateSyntaxError" in message


def test_a_template_with_transformers_extras_renders_as_transformers_does(checkpoint: Checkpoint) -> None:
    transformers = pytest.importorskip("transformers")
    set_template(checkpoint, EXTRAS_TEMPLATE)
    tok = load_model(checkpoint.path, CPU).tokenizer
    assert isinstance(tok, HFTokenizer)
    reference = transformers.AutoTokenizer.from_pretrained(checkpoint.path)
    expected = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert '<user>"hi <x> ü"yo' in expected and "outer" in expected and "[4]" in expected
    assert tok.decode(tok.apply_chat_template(MESSAGES)) == expected
    assert tok.apply_chat_template(MESSAGES) == reference(expected, add_special_tokens=False).input_ids


def test_tools_reach_a_template_as_transformers_gives_them(checkpoint: Checkpoint) -> None:
    """`tools` is None where the request has none, as in transformers (and so vLLM): a template
    that tests `tools is not none`, as Mistral's does, renders no tool block then."""
    transformers = pytest.importorskip("transformers")
    set_template(
        checkpoint,
        "{% if tools is not none %}[TOOLS]{{ tools | tojson }}[/TOOLS]{% endif %}"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    )
    tok = load_model(checkpoint.path, CPU).tokenizer
    reference = transformers.AutoTokenizer.from_pretrained(checkpoint.path)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for given in (None, [], tools):
        expected = reference.apply_chat_template(
            MESSAGES, tools=given, add_generation_prompt=True, tokenize=False
        )
        assert tok.decode(tok.apply_chat_template(MESSAGES, tools=given)) == expected
    assert "[TOOLS]" not in tok.decode(tok.apply_chat_template(MESSAGES))


def test_a_non_numeric_rope_theta_is_a_load_error_naming_config_json(checkpoint: Checkpoint) -> None:
    path = checkpoint.path / "config.json"
    config = json.loads(path.read_text())
    config.pop("rope_parameters", None)
    config["rope_theta"] = "abc"
    path.write_text(json.dumps(config))
    message = load_error(checkpoint.path)
    assert "config.json" in message and "rope_theta" in message and "'abc'" in message


def test_null_num_key_value_heads_means_one_kv_head_per_query_head(checkpoint: Checkpoint) -> None:
    # transformers reads `"num_key_value_heads": null` as "as many as the attention heads".
    path = checkpoint.path / "config.json"
    config = json.loads(path.read_text())
    config["num_key_value_heads"] = None
    path.write_text(json.dumps(config))
    # The checkpoint has 2 KV heads of 4, so the shapes must now disagree: MHA was inferred.
    message = load_error(checkpoint.path)
    assert "k_proj" in message and "(32, 64)" in message and "(64, 64)" in message


def test_a_checkpoint_given_as_dot_is_served_under_its_directory_name(
    checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `tierserve serve --model .` named the model "" (Path(".").name), and no request can
    # name an empty model.
    from tierserve.server.backends import build_backend

    monkeypatch.chdir(checkpoint.path)
    assert build_backend("torch", ".").model_name == checkpoint.path.name
    monkeypatch.chdir(checkpoint.path / "..")
    assert build_backend("torch", f"{checkpoint.path.name}/").model_name == checkpoint.path.name


def test_a_chat_template_file_wins_over_the_one_in_tokenizer_config(checkpoint: Checkpoint) -> None:
    """As in transformers (and so vLLM): a checkpoint that kept an older template in
    tokenizer_config.json beside its chat_template.jinja got prompts built by the old one."""
    transformers = pytest.importorskip("transformers")
    set_template(checkpoint, "OLD{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    (checkpoint.path / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tok = load_model(checkpoint.path, CPU).tokenizer
    assert isinstance(tok, HFTokenizer)
    messages = [{"role": "user", "content": "hi"}]
    reference = transformers.AutoTokenizer.from_pretrained(checkpoint.path)
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert expected == "<user>hi<|assistant|>" and tok.decode(tok.apply_chat_template(messages)) == expected


def test_model_safetensors_is_read_before_an_index_beside_it(make_checkpoint) -> None:
    """transformers reads model.safetensors when it is there; the index's shards were read
    instead, and the model answered with other weights."""
    from torch_paged_runner import prompt_logits

    from tierserve.executors.pytorch.executor import build_torch_executor

    single, sharded = make_checkpoint(seed=1), make_checkpoint(max_shard_size="60KB", seed=2)
    (sharded.path / "model.safetensors").write_bytes((single.path / "model.safetensors").read_bytes())
    executor, _ = build_torch_executor(sharded.path, dtype=torch.float64, num_device_blocks=8)
    prompt = [5, 9, 200, 31, 7]
    torch.testing.assert_close(prompt_logits(executor, prompt), single.logits(prompt), atol=1e-9, rtol=1e-9)


def test_two_weight_files_with_the_same_tensor_and_no_index_are_refused(checkpoint: Checkpoint) -> None:
    """Each tensor was taken from whichever file sorted last: a stale copy won without a word."""
    weights = checkpoint.path / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    (checkpoint.path / "a.safetensors").write_bytes(data)
    (checkpoint.path / "old-a.safetensors").write_bytes(data)
    message = load_error(checkpoint.path)
    assert "old-a.safetensors" in message and "also in a.safetensors" in message and "ambiguous" in message


def test_a_config_larger_than_its_weights_is_refused_before_the_model_is_allocated(
    checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An 8 B model's config beside tiny weights: the loader filled 24 GB (and was killed)
    before its first check. The headers are read first now."""
    from tierserve.executors.pytorch import loader

    def not_allocated(*_args: object) -> None:
        raise AssertionError("the model was allocated before its tensors were checked")

    monkeypatch.setattr(loader, "_unfilled_model", not_allocated)
    config_path = checkpoint.path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32)
    config_path.write_text(json.dumps(config))
    message = load_error(checkpoint.path)
    assert "not found in model.safetensors" in message


def test_weights_larger_than_the_free_memory_are_refused_in_one_line(
    checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierserve.executors.pytorch import loader

    monkeypatch.setattr(loader, "free_bytes", lambda _device: 4096)
    message = load_error(checkpoint.path)
    assert "config.json" in message and "GiB in float32 on cpu, more than" in message


def test_a_chat_template_file_that_is_not_utf8_is_named(checkpoint: Checkpoint) -> None:
    (checkpoint.path / "chat_template.jinja").write_bytes(b"{{ messages }}\xff\xfe")
    message = load_error(checkpoint.path)
    assert "chat_template.jinja" in message and "not UTF-8" in message


def test_weights_saved_from_the_base_model_say_their_names_lack_the_prefix(checkpoint: Checkpoint) -> None:
    from safetensors.torch import load_file, save_file

    weights = checkpoint.path / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({k.removeprefix("model."): v for k, v in tensors.items()}, str(weights))
    assert "lack the 'model.' prefix" in load_error(checkpoint.path)


def test_llama3_original_positions_at_the_top_level_and_in_the_scaling_must_agree(
    checkpoint: Checkpoint,
) -> None:
    """transformers reads a top-level original_max_position_embeddings first, vLLM the
    scaling's: the rotation differed from transformers' from the first token."""
    from tierserve.executors.pytorch.hf_config import parse_hf_config

    path = checkpoint.path / "config.json"
    config = json.loads(path.read_text())
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    base = config["rope_parameters"]  # transformers 5 writes rope_parameters (its rope_theta inside)
    config.update(rope_parameters={**base, **scaling, "original_max_position_embeddings": 64})
    config["original_max_position_embeddings"] = 128
    path.write_text(json.dumps(config))
    assert "original_max_position_embeddings is 128 at the top level and 64" in load_error(checkpoint.path)
    config["rope_parameters"] = {**base, **scaling}  # only at the top level: read there, as transformers does
    path.write_text(json.dumps(config))
    rope = parse_hf_config(path).config.rope_scaling
    assert rope is not None and rope.original_max_position_embeddings == 128


def test_a_memory_cgroup_limit_is_the_room_a_container_has(tmp_path: Path) -> None:
    """In a container /proc/meminfo shows the host's memory: the check let a model past the
    container's limit through, to be killed without a word. The room is the least, over the
    limited levels from the process's own cgroup up, of the limit less that level's use
    (a sibling's too) but the page cache the kernel may take back."""
    from tierserve.executors.pytorch.loader import cgroup_room

    gib = 1 << 30
    own = tmp_path / "self-cgroup"
    v2 = tmp_path / "v2"
    pod, mine = v2 / "pod", v2 / "pod" / "me"
    mine.mkdir(parents=True)
    own.write_text("0::/pod/me\n")
    (pod / "memory.max").write_text(f"{40 * gib}\n")  # the pod's limit binds its containers
    (pod / "memory.current").write_text(f"{34 * gib}\n")  # 19 of them mine, 15 a sibling's
    (pod / "memory.stat").write_text(f"inactive_file {17 * gib}\n")
    (mine / "memory.max").write_text("max\n")
    (mine / "memory.current").write_text(f"{19 * gib}\n")
    (mine / "memory.stat").write_text(f"anon {2 * gib}\ninactive_file {17 * gib}\n")
    assert cgroup_room(v2, own) == 23 * gib  # 40 - 34 + 17: a checkpoint just read is cache
    (mine / "memory.max").write_text(f"{30 * gib}\n")
    assert cgroup_room(v2, own) == 23 * gib  # 30 - 19 + 17 = 28 is not the least
    (pod / "memory.stat").write_text("inactive_file 0\n")
    assert cgroup_room(v2, own) == 6 * gib  # the sibling's use counts: 40 - 34
    for level in (pod, mine):
        (level / "memory.max").write_text("max\n")
    assert cgroup_room(v2, own) is None
    v1 = tmp_path / "v1"
    job = v1 / "memory" / "job"
    job.mkdir(parents=True)
    own.write_text("12:memory:/job\n0::/\n")  # a hybrid host: v1's memory controller
    (job / "memory.limit_in_bytes").write_text(str(4 * gib))
    (job / "memory.usage_in_bytes").write_text("300")
    (job / "memory.stat").write_text("total_inactive_file 100\n")
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))  # the root: no limit
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(8 * gib))
    assert cgroup_room(v1, own) == 4 * gib - 200
    (job / "memory.limit_in_bytes").write_text(str(2**63 - 4096))
    assert cgroup_room(v1, own) is None
    assert cgroup_room(tmp_path / "none", tmp_path / "no-such-file") is None
