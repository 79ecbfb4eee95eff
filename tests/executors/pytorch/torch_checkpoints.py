"""Tiny random Hugging Face checkpoints, written by the tests themselves (no downloads)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB_SIZE = 320  # the test tokenizer uses 300 ids
BOS_ID, EOS_ID = 0, 1
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
    "{{ eos_token }}{% endif %}"  # tools, a message's name, calls and call id, as Llama-3.1's shows them
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m.name %}[{{ m.name }}]{% endif %}{{ m['content'] }}"
    "{% if m.tool_calls %}[calls:{% for c in m.tool_calls %}{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}]"
    "{% endif %}"
    "{% if m.tool_call_id %}[id:{{ m.tool_call_id }}]{% endif %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}Done!{% endif %}"  # a template variable
)
_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog. " * 4,
    "Stop here. Done! <|user|> <|assistant|> ünïcödé 日本語 0123456789",
]


@lru_cache(maxsize=1)
def tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 5, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    return str(tok.to_str())


@dataclass
class Checkpoint:
    path: Path
    hf: Any  # the transformers model whose weights were saved, in float64, eval mode

    def greedy(self, prompt: list[int], num_tokens: int, **generate_kw: Any) -> list[int]:
        """Reference: transformers' generate(), greedy, EOS ignored."""
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = self.hf.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num_tokens,
                do_sample=False,
                **generate_kw,
            )
        return [int(t) for t in out[0, len(prompt) :]]

    def logits(self, prompt: list[int]) -> Any:
        with torch.no_grad():
            return self.hf(torch.tensor([prompt])).logits[0]


def write_checkpoint(
    path: Path,
    *,
    arch: str = "llama",
    num_heads: int = 4,
    num_kv_heads: int = 2,
    hidden_size: int = 64,
    head_dim: int | None = None,
    rope_scaling: dict[str, Any] | None = None,
    tie: bool = False,
    attention_bias: bool = False,
    mlp_bias: bool = False,
    max_shard_size: str | None = None,
    seed: int = 0,
) -> Checkpoint:
    """Save a 2-layer random model plus tokenizer files to `path`. Biases and Qwen3's query/key
    norm weights are drawn at random too (transformers starts them at 0 and 1), so each matters."""
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        initializer_range=0.2,  # peaked logits: greedy choices are far from ties
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
        kwargs["rope_theta"] = 500000.0
    if attention_bias:
        kwargs["attention_bias"] = True
    if mlp_bias:
        kwargs["mlp_bias"] = True
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    if arch == "mistral":
        kwargs["sliding_window"] = None
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1, 0.3)
    path.mkdir(parents=True, exist_ok=True)
    save: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size:
        save["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save)
    (path / "tokenizer.json").write_text(tokenizer_json())
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE})
    )
    model = model.to(torch.float64)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = EOS_ID
    return Checkpoint(path, model)


def edit_json(path: Path, **changes: object) -> None:
    """Set each key of a JSON file (config.json, tokenizer_config.json, ...); None removes it."""
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def add_tokens_past_the_vocabulary(path: Path) -> str:
    """Give the checkpoint's tokenizer added tokens <x0>, <x1>, ... after its 300 ids, up to
    the model's last id and one past it; returns that one past (a token the model has no
    embedding for)."""
    tokenizer = path / "tokenizer.json"
    data = json.loads(tokenizer.read_text())
    extra = VOCAB_SIZE - 300 + 1
    data["added_tokens"] += [
        {"id": 300 + n, "content": f"<x{n}>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for n in range(extra)
    ]  # fmt: skip
    tokenizer.write_text(json.dumps(data))
    return f"<x{extra - 1}>"
