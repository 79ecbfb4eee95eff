"""Parse a Hugging Face `config.json` into a `ModelConfig`, rejecting what we cannot run."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierserve.model_config import ModelConfig, RopeScaling
from tierserve.request import SamplingDefaults, SamplingParams

logger = logging.getLogger(__name__)


class ModelLoadError(Exception):
    """A model directory cannot be loaded; the message names the file and what is wrong."""


# config.json's model_type -> the architecture it names, for files without `architectures`.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_TYPES.values())
# What transformers' config class of each architecture gives a key config.json leaves out
# (transformers 5.24's LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config): read as any
# other default, a Mistral file without `sliding_window` ran with no window where
# transformers slides one of 4096 tokens.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "MistralForCausalLM": {
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
    },
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
}
_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
ORIGINAL = "original_max_position_embeddings"


@dataclass(frozen=True)
class DecoderOptions:
    """Where a checkpoint's decoder departs from plain Llama, as its transformers class builds it.

    Qwen2 has q/k/v biases and no o bias; Llama's `attention_bias` puts biases on all four
    projections and `mlp_bias` on gate, up and down; Qwen3 (`attention_bias` too) normalises
    each query and key head with its own RMSNorm (`q_norm`, `k_norm`) before the rotation.
    `rope_linear_factor` is rope_type "linear": every rotary frequency is divided by it.
    """

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_linear_factor: float = 1.0


PLAIN_LLAMA = DecoderOptions()


@dataclass(frozen=True)
class HFModelSpec:
    config: ModelConfig
    architecture: str
    options: DecoderOptions
    checkpoint_dtype: str | None  # "bfloat16", ... as the checkpoint declares it
    max_model_len: int  # positions the model may attend over (a sliding window caps it)
    quantization: str | None = None  # `quantization_config`'s method ("?" unnamed); None: not quantized
    context_note: str = ""  # why max_model_len is below max_position_embeddings, if it is
    # generation_config.json's sampling settings, for the fields a request leaves out.
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    def context_said(self) -> str:
        """ "the model's context of N tokens", and why, where it is not the model's positions."""
        return f"the model's context of {self.max_model_len} tokens{self.context_note}"


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _int(path: Path, raw: dict[str, Any], key: str, default: int | None = None) -> int:
    # null counts as absent, as in transformers (`"num_key_value_heads": null` means MHA)
    value = default if raw.get(key) is None else raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = "missing" if raw.get(key) is None else f"must be a positive integer, got {value!r}"
        raise ModelLoadError(f"{path}: {key}: {what}")
    return value


def _float(path: Path, raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ModelLoadError(f"{path}: {key}: must be a positive number, got {value!r}")
    return float(value)


def _flag(path: Path, raw: dict[str, Any], key: str) -> bool:
    """A true/false key (null or absent: false), refusing a string such as "false"."""
    value = raw.get(key)
    if value is not None and not isinstance(value, bool):
        raise ModelLoadError(f"{path}: {key}: must be true or false, got {value!r}")
    return bool(value)


def _architecture(path: Path, raw: dict[str, Any]) -> str:
    archs = raw.get("architectures")
    model_type = raw.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ModelLoadError(f"{path}: model_type: expected a string, got {model_type!r}")
    if isinstance(archs, list) and archs:
        arch = str(archs[0])
        builds = _MODEL_TYPES.get(model_type or "")
        if builds is not None and arch.lower() == builds.lower():
            arch = builds  # "LLaMAForCausalLM" (early conversions): transformers goes by model_type
    elif model_type in _MODEL_TYPES:
        arch = _MODEL_TYPES[model_type]
    elif model_type is not None:
        known = ", ".join(_MODEL_TYPES)
        raise ModelLoadError(f"{path}: model_type {model_type!r} is not supported (supported: {known})")
    else:
        raise ModelLoadError(f"{path}: no 'architectures' list and no 'model_type'")
    if arch not in SUPPORTED_ARCHITECTURES:
        known = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r} (supported: {known})")
    if model_type is not None and _MODEL_TYPES.get(str(model_type)) != arch:
        # transformers builds the model by model_type: a Llama-named file of model_type
        # "mistral" slides a window the Llama reading ignored.
        builds = _MODEL_TYPES.get(str(model_type), "a model tierserve does not support")
        raise ModelLoadError(
            f"{path}: architectures names {arch} but model_type {model_type!r}, from which transformers "
            f"builds {builds}: make the two agree"
        )
    return arch


def _positive_int(path: Path, what: str, value: Any) -> int:
    """`value` if it is a positive integer, 8192.0 included (32.7 is not: read as 32, it
    rotated otherwise)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{path}: {what}: must be a positive integer, got {value!r}")
    return value


def _default(arch: str, key: str, fallback: Any) -> Any:
    return _ARCH_DEFAULTS.get(arch, {}).get(key, fallback)


def _rope_params(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"{path}: rope_scaling: expected an object, got {params!r}")
    return params


def _rope(path: Path, raw: dict[str, Any], any_kind: bool = False) -> tuple[float, RopeScaling | None, float]:
    """(rope_theta, Llama-3 scaling or None, the linear scaling factor: 1.0 when not linear).
    `any_kind`: a rope type the torch executor cannot rotate by is read as none (the
    simulator: no rotation changes a step's work or the K/V it keeps)."""
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older files
    # have `rope_theta` and `rope_scaling` at the top level. transformers reads
    # `rope_scaling` first: one added beside `rope_parameters` (an edit, say) must agree.
    _check_one_rope(path, raw)
    params = _rope_params(path, raw)
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ModelLoadError(f"{path}: rope_theta: must be a positive number, got {theta!r}")
    theta = float(theta)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None, 1.0
    if kind == "linear":
        factor = params.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ModelLoadError(
                f"{path}: linear rope scaling: factor must be a positive number, got {factor!r}"
            )
        return theta, None, float(factor)
    if kind != "llama3" and any_kind:
        return theta, None, 1.0
    if kind != "llama3":
        raise ModelLoadError(
            f"{path}: rope_type {kind!r} is not supported (supported: default, linear, llama3)"
        )
    original = _original_positions(path, raw, params)
    if original is None:
        raise ModelLoadError(f"{path}: llama3 rope scaling: missing or invalid '{ORIGINAL}'")
    original = _positive_int(path, f"llama3 rope scaling: {ORIGINAL}", original)
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=original,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: llama3 rope scaling: missing or invalid {e}") from None
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ModelLoadError(f"{path}: llama3 rope scaling: high_freq_factor must exceed low_freq_factor")
    return theta, scaling, 1.0


def _decoder_options(path: Path, raw: dict[str, Any], arch: str, linear_factor: float) -> DecoderOptions:
    """The biases and norms transformers' class for `arch` builds from config.json."""
    attention_bias, mlp_bias = _flag(path, raw, "attention_bias"), _flag(path, raw, "mlp_bias")
    if arch == "Qwen2ForCausalLM":  # q/k/v biases whatever the keys say, as transformers builds it
        return DecoderOptions(qkv_bias=True, rope_linear_factor=linear_factor)
    # transformers' Mistral has no biases at all, and its Qwen3 none in the MLP: it would drop
    # such biases from the weights, where other servers (vLLM) add them. Neither is safe to guess.
    ignored = {"MistralForCausalLM": ("attention_bias", "mlp_bias"), "Qwen3ForCausalLM": ("mlp_bias",)}
    for key in ignored.get(arch, ()):
        if raw.get(key):
            raise ModelLoadError(
                f"{path}: {key} is not supported for {arch}, which has no such biases in transformers"
            )
    return DecoderOptions(
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=mlp_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
        rope_linear_factor=linear_factor,
    )


def _original_positions(path: Path, raw: dict[str, Any], params: dict[str, Any]) -> Any:
    """The scaling's `original_max_position_embeddings`, else a top-level one (None if
    neither). transformers reads a top-level one first, vLLM the scaling's: two that differ
    scale differently in the two, so neither is guessed."""
    top, inner = raw.get(ORIGINAL), params.get(ORIGINAL)
    if top is not None and inner is not None and top != inner:
        raise ModelLoadError(
            f"{path}: {ORIGINAL} is {top!r} at the top level and {inner!r} in the rope scaling "
            "(transformers reads the first, vLLM the second): keep one"
        )
    return inner if inner is not None else top


def _scaled_context(path: Path, raw: dict[str, Any], max_positions: int) -> int:
    """The context vLLM serves a model at, from its rope scaling: `max_position_embeddings`
    times the scaling's factor (YaRN: its `original_max_position_embeddings` times it), but
    for llama3, longrope and su, whose `max_position_embeddings` already is the scaled one
    (vLLM's `_get_and_verify_max_len`). Qwen2.5's and Qwen3's model cards add YaRN with
    factor 4 to a 32,768-position config for 131,072 tokens."""
    params = _rope_params(path, raw)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default", "llama3", "longrope", "su"):
        return max_positions
    factor = params.get("factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < math.inf:
        raise ModelLoadError(f"{path}: {kind} rope scaling: factor must be a positive number, got {factor!r}")
    base = max_positions
    if kind == "yarn":
        original = _original_positions(path, raw, params)
        base = max_positions if original is None else original
    return int(_positive_int(path, f"yarn rope scaling: {ORIGINAL}", base) * factor)


def _dtype_bytes(path: Path, dtype: Any) -> int:
    """Bytes of one weight in the checkpoint's declared dtype (none declared: 16 bits)."""
    if dtype is None:
        return 2
    size = _DTYPES.get(str(dtype).removeprefix("torch."))
    if size is None:  # an fp8 file without a quantization_config was priced as bfloat16
        known = ", ".join(_DTYPES)
        raise ModelLoadError(f"{path}: torch_dtype {dtype!r} is not supported (supported: {known})")
    return size


def _check_one_rope(path: Path, raw: dict[str, Any]) -> None:
    """Refuse `rope_scaling` and `rope_parameters` that say different things, the rotation's
    base included (transformers takes it from `rope_scaling`, else the top-level
    `rope_theta`): the rotation transformers applies, and tierserve, would then differ."""
    scaling, parameters = raw.get("rope_scaling"), raw.get("rope_parameters")
    if not (isinstance(scaling, dict) and isinstance(parameters, dict) and scaling and parameters):
        return
    top_theta = raw.get("rope_theta", 10000.0)

    def scaling_of(params: dict[str, Any]) -> dict[str, Any]:
        kind = params.get("rope_type", params.get("type", "default"))
        rest = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta")}
        return {"rope_type": kind, "rope_theta": params.get("rope_theta", top_theta), **rest}

    if scaling_of(scaling) != scaling_of(parameters):
        raise ModelLoadError(
            f"{path}: rope_scaling {scaling!r} and rope_parameters {parameters!r} disagree (transformers "
            "reads rope_scaling first, and its rope_theta, else the top-level one): keep one"
        )


def _refuse_sliding_window(path: Path, raw: dict[str, Any]) -> None:
    kinds = raw.get("layer_types") or []
    if raw.get("use_sliding_window") and not kinds:
        # Qwen2/Qwen3, as transformers builds them: layers from max_window_layers on slide
        # the window; with as many such layers as the model has, none does.
        window, first = raw.get("sliding_window", 4096), raw.get("max_window_layers", 28)
        if isinstance(first, float) and first.is_integer():
            first = int(first)
        layers = raw.get("num_hidden_layers")
        none_slides = isinstance(first, int) and isinstance(layers, int) and first >= layers
        if window is not None and not none_slides:
            raise ModelLoadError(
                f"{path}: use_sliding_window: the layers from max_window_layers ({first!r}) on slide a "
                f"window of {window!r} tokens, which is not supported (only full attention)"
            )
    # Qwen2/Qwen3 may name each layer's kind; without use_sliding_window transformers itself
    # cannot build a sliding layer's mask.
    if not isinstance(kinds, list):
        raise ModelLoadError(f"{path}: layer_types: expected a list, got {kinds!r}")
    other = next((kind for kind in kinds if kind != "full_attention"), None)
    if other is not None:
        raise ModelLoadError(f"{path}: layer_types: only full_attention layers are supported, got {other!r}")


def _quantization(raw: dict[str, Any]) -> str | None:
    """`quantization_config`'s method ("?" where it names none); None for plain weights."""
    quantized = raw.get("quantization_config")
    if quantized is None:
        return None
    return str(quantized.get("quant_method", "?")) if isinstance(quantized, dict) else "?"


def _eos_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return ()


def parse_hf_config(
    path: Path, generation_config: dict[str, Any] | None = None, *, simulated: bool = False
) -> HFModelSpec:
    """Read `path` (config.json); EOS ids come from generation_config.json when it has them.
    `simulated`: for the simulator, which runs no rotation: any rope type is read, and the
    context is the one vLLM serves the model at (`_scaled_context`)."""
    raw = read_json(path)
    arch = _architecture(path, raw)
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' one function, two names
        raise ModelLoadError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    _refuse_sliding_window(path, raw)
    hidden = _int(path, raw, "hidden_size")
    heads, kv_heads, head_dim = _attention_heads(path, raw, arch, hidden)
    theta, scaling, linear_factor = _rope(path, raw, any_kind=simulated)
    options = _decoder_options(path, raw, arch, linear_factor)
    dtype = raw.get("dtype") or raw.get("torch_dtype")  # transformers >= 5 reads `dtype` first
    gen = generation_config or {}
    eos = _eos_ids(gen.get("eos_token_id")) or _eos_ids(raw.get("eos_token_id"))
    bos = raw.get("bos_token_id")
    config = ModelConfig(
        name=str(raw.get("_name_or_path") or path.parent.name),
        vocab_size=_int(path, raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(path, raw, "intermediate_size"),
        num_hidden_layers=_int(path, raw, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=_int(
            path, raw, "max_position_embeddings", _default(arch, "max_position_embeddings", 2048)
        ),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=_float(path, raw, "rms_norm_eps", 1e-6),
        tie_word_embeddings=_flag(path, raw, "tie_word_embeddings"),
        head_dim=head_dim,
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=eos,
        dtype_bytes=_dtype_bytes(path, dtype),
    )
    max_len, note = _context(path, raw, arch, config.max_position_embeddings, simulated)
    dtype_name = str(dtype) if dtype else None
    defaults = _sampling_defaults(path.with_name("generation_config.json"), gen)
    return HFModelSpec(config, arch, options, dtype_name, max_len, _quantization(raw), note, defaults)


def _sampling_defaults(path: Path, gen: dict[str, Any]) -> SamplingDefaults:
    """The sampling settings `gen` (generation_config.json) gives, as vLLM reads them for the
    fields a request leaves out (`do_sample` is not read, by vLLM either). A value the
    sampler would refuse is refused, naming the file and key; vLLM's other two, `min_p`
    (not supported) and `max_new_tokens`, are logged as not applied."""
    if said := ", ".join(f"{k} {gen[k]!r}" for k in ("min_p", "max_new_tokens") if gen.get(k) is not None):
        logger.warning("%s: %s not applied (vLLM applies them)", path, said)
    found: dict[str, Any] = {}
    for key, is_int in (
        ("temperature", False),
        ("top_p", False),
        ("top_k", True),
        ("presence_penalty", False),
        ("frequency_penalty", False),
        ("repetition_penalty", False),
    ):
        value = gen.get(key)
        if value is None:
            continue
        number = isinstance(value, int) if is_int else isinstance(value, (int, float))
        if isinstance(value, bool) or not number or not math.isfinite(value):
            raise ModelLoadError(
                f"{path}: {key}: expected {'an integer' if is_int else 'a number'}, got {value!r}"
            )
        found[key] = value
    if found.get("top_k", 0) == -1:  # vLLM's "off", transformers' 0
        found["top_k"] = 0
    try:
        SamplingParams(**found)  # its checks
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    return SamplingDefaults(**found)


def _attention_heads(path: Path, raw: dict[str, Any], arch: str, hidden: int) -> tuple[int, int, int | None]:
    """(query heads, KV heads, head_dim or None for hidden_size / heads), as transformers
    builds them, refusing what does not divide."""
    heads = _int(path, raw, "num_attention_heads")
    # Absent: the config class's default; null: as many as the query heads (MHA).
    kv_default = heads if "num_key_value_heads" in raw else _default(arch, "num_key_value_heads", heads)
    kv_heads = _int(path, raw, "num_key_value_heads", kv_default)
    if heads % kv_heads:
        raise ModelLoadError(
            f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    head_dim = raw.get("head_dim")
    if head_dim is None and arch == "Qwen3ForCausalLM":
        head_dim = 128  # transformers' Qwen3Config default, not hidden_size / heads
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2):
        raise ModelLoadError(f"{path}: head_dim must be a positive even integer, got {head_dim!r}")
    if head_dim is None and hidden % heads:
        raise ModelLoadError(f"{path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    return heads, kv_heads, head_dim


def _context(
    path: Path, raw: dict[str, Any], arch: str, max_positions: int, simulated: bool
) -> tuple[int, str]:
    """The positions a request may span, and why where it is below `max_positions` ("": it is
    not): the simulator's is the one vLLM serves the model at; a Mistral window caps it."""
    max_len = _scaled_context(path, raw, max_positions) if simulated else max_positions
    window = raw.get("sliding_window", _default(arch, "sliding_window", None))
    if arch != "MistralForCausalLM" or window is None:
        return max_len, ""
    if raw.get("layer_types"):
        # transformers builds a Mistral file with layer_types as Ministral, whose layers slide
        # the window only where layer_types says so; every one here is full attention (any
        # other kind is refused), so no window applies.
        return max_len, ""
    # Within the window, sliding attention is full attention: contexts are capped to it.
    window = _positive_int(path, "sliding_window", window)
    if window >= max_len:
        return max_len, ""
    return window, " (its sliding_window: attention past the window is not supported)"
