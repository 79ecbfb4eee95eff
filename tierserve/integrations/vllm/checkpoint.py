"""A tiny random Llama checkpoint with its tokenizer, written locally (never downloaded).

The plug-in's tests and `tierserve bench vllm` run vLLM's CPU build on it: 2 layers,
hidden 128, head_dim 32 (vLLM's CPU attention needs head_dim >= 32). Peaked random
weights keep greedy choices far from ties, so two runs agree token for token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB_SIZE = 320  # the tokenizer uses 300 ids
BOS_ID, EOS_ID = 0, 1
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = (
    "the tiers share one pool of blocks, and the most urgent keep a floor of their own. " * 3,
    "Realtime, online, batch, background: 0123456789 <|user|> <|assistant|>",
)


def _tokenizer_json() -> str:
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
    tok.train_from_iterator(list(_CORPUS) * 5, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    return str(tok.to_str())


def write_tiny_llama(path: Path, *, seed: int = 0, max_position_embeddings: int = 2048) -> Path:
    """Write the checkpoint to `path` (once: an existing one is kept) and return `path`."""
    import torch
    import transformers

    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    config: Any = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        initializer_range=0.2,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.json").write_text(_tokenizer_json())
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return path
