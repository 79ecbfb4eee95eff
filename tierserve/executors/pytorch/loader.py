"""Load a model and its tokenizer: the seeded demo model, or a local Hugging Face directory.

Never touches the network. A directory holds config.json, *.safetensors (one file, or
shards listed in model.safetensors.index.json), tokenizer.json, and optionally
tokenizer_config.json (chat template, special tokens) and generation_config.json (EOS).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierserve.executors.pytorch.hf_config import (
    PLAIN_LLAMA,
    DecoderOptions,
    ModelLoadError,
    parse_hf_config,
    read_json,
)
from tierserve.executors.pytorch.model import CausalLM
from tierserve.executors.pytorch.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from tierserve.model_config import DEMO_MODEL, ModelConfig
from tierserve.request import SamplingDefaults

logger = logging.getLogger(__name__)

DEMO_SEED = 0
_INIT_STD = 0.02  # Hugging Face's default initializer_range
_HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    max_model_len: int
    context_note: str = ""  # why max_model_len is below the model's positions (`HFModelSpec`)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)


def make_demo_model(
    device: torch.device, dtype: torch.dtype = torch.float32, seed: int = DEMO_SEED
) -> CausalLM:
    """The demo model with weights drawn from a fixed seed: identical on every start-up."""
    model = CausalLM(DEMO_MODEL)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.checkpoint_tensors().items()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * _INIT_STD)
    return model.to_device(device, dtype)


def make_random_model(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    options: DecoderOptions = PLAIN_LLAMA,
) -> CausalLM:
    """A model of `config`'s shape with random weights, for timing: never meant to make text.

    The parameters are allocated on `device` in `dtype` and filled there (no copy on the
    host): an 8 B model in bfloat16 on a GPU takes its 16 GB there and seconds to make.
    Not the demo's weights: `make_demo_model` draws those on the CPU, in its own order.
    """
    model = _unfilled_model(config, device, dtype, options)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.checkpoint_tensors().items()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, _INIT_STD, generator=gen)
    return model


def _unfilled_model(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    options: DecoderOptions = PLAIN_LLAMA,
) -> CausalLM:
    """A model of `config`'s shape on `device`, its weights allocated but not filled. The dtype
    comes first, on the meta device: the weights are allocated once, at their size (not in
    float32 and then cast, three times a half-precision model's size at the peak)."""
    with torch.device("meta"):
        model = CausalLM(config, options)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    return model.to_device(device, dtype)


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it (for error messages and loading). The files
    transformers would read, in its order: `model.safetensors` alone, else the shards its index
    lists, else every `*.safetensors` in the folder, none of which may repeat a tensor (a
    stale copy beside the weights was read instead of them, without a word)."""
    single = directory / "model.safetensors"
    if single.is_file():
        return _tensors_of([single])
    index_path = directory / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index_path}: no 'weight_map' object")
        files = {name: directory / str(f) for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise ModelLoadError(f"{f}: missing file (listed in {index_path.name})")
        return files
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(
            f"{directory}: missing file: no *.safetensors weights{_unread_weights(directory)}"
        )
    return _tensors_of(shards)


def _tensors_of(shards: list[Path]) -> dict[str, Path]:
    from safetensors import SafetensorError, safe_open

    files: dict[str, Path] = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors file, not a dict)
                    if name in files:
                        raise ModelLoadError(
                            f"{shard}: tensor {name!r} is also in {files[name].name}: which weights "
                            "to load is ambiguous (remove the stale file, or add "
                            "model.safetensors.index.json)"
                        )
                    files[name] = shard
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{shard}: unreadable safetensors: {e}") from None
    return files


def _unread_weights(directory: Path) -> str:
    """A hint naming weights in a format this loader does not read (PyTorch pickles, GGUF), if any."""
    patterns = ("pytorch_model*.bin", "*.pt", "*.pth", "*.gguf")
    found = sorted({p.name for pattern in patterns for p in directory.glob(pattern)})
    if not found:
        return ""
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    return f" ({found[0]}{more} found, but only safetensors weights are read: convert them to safetensors)"


def check_tensors(directory: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, Path]:
    """The file of each tensor, once the safetensors headers show every tensor of `shapes` at
    its shape and no layer tensor besides: read before the model's memory is (a config of
    an 8 B model beside a tiny checkpoint took 24 GB, and the process, before the first
    check). A layer tensor that the model does not have is an error too."""
    from safetensors import SafetensorError, safe_open

    files = _weight_files(directory)
    where = ", ".join(sorted({p.name for p in files.values()}))
    missing = [name for name in shapes if name not in files]
    if missing:
        hint = ""
        if all(not name.startswith("model.") for name in files if name != "lm_head.weight"):
            hint = (
                "; the weights' names lack the 'model.' prefix (saved from the base model, not *ForCausalLM)"
            )
        raise ModelLoadError(
            f"{directory}: tensor {missing[0]!r} not found in {where} ({len(missing)} missing{hint})"
        )
    # A layer tensor the model has no place for means config.json does not describe these
    # weights (biases without attention_bias, more layers than num_hidden_layers): loading
    # without it would compute something else. Old checkpoints' rotary inv_freq is recomputed.
    unused = sorted(
        name
        for name in files
        if name.startswith("model.layers.") and name not in shapes and not name.endswith(".inv_freq")
    )
    if unused:
        raise ModelLoadError(
            f"{files[unused[0]]}: tensor {unused[0]!r} has no place in the model config.json describes "
            f"({len(unused)} such tensors; check attention_bias, mlp_bias, num_hidden_layers, architectures)"
        )
    for path, names in _by_file(files, shapes).items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != shapes[name]:
                        raise ModelLoadError(
                            f"{path}: tensor {name!r} has shape {shape}, config.json implies {shapes[name]}"
                        )
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path}: unreadable safetensors: {e}") from None
    return files


def _by_file(files: dict[str, Path], names: Iterable[str]) -> dict[Path, list[str]]:
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    return by_file


def load_weights(model: CausalLM, directory: Path, files: dict[str, Path] | None = None) -> None:
    """Copy every parameter of `model` from the directory's safetensors; `files`: what
    `check_tensors` gave for this model, else it runs first."""
    from safetensors import SafetensorError, safe_open

    expected = model.checkpoint_tensors()
    if files is None:
        files = check_tensors(directory, {name: tuple(t.shape) for name, t in expected.items()})
    with torch.no_grad():
        for path, names in _by_file(files, expected).items():
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in names:
                        expected[name].copy_(f.get_tensor(name))
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(f"{path}: unreadable safetensors: {e}") from None
        if model.lm_head is None and "lm_head.weight" in files:
            _check_tied_head(files["lm_head.weight"], expected["model.embed_tokens.weight"])


def _check_tied_head(path: Path, embed: torch.Tensor) -> None:
    """config.json ties the output head to the embeddings, yet the weights hold an lm_head.weight
    too. The same values are harmless; different ones are a checkpoint that says two things:
    transformers (5) then leaves the head untied and uses it, vLLM skips it and uses the
    embeddings. Either guess computes other logits than one of them, so the user says which."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            head = f.get_tensor("lm_head.weight")
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{path}: unreadable safetensors: {e}") from None
    # Compared as loaded (the embeddings may have been cast): equal values stay equal.
    if tuple(head.shape) != tuple(embed.shape) or not torch.equal(head.to(embed), embed):
        raise ModelLoadError(
            f"{path}: tensor 'lm_head.weight' differs from 'model.embed_tokens.weight', but config.json "
            "ties them (tie_word_embeddings): set it to false to use lm_head.weight, or remove "
            "lm_head.weight from the weights to use the embeddings"
        )


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def load_tokenizer(directory: Path, config: ModelConfig) -> HFTokenizer:
    from tokenizers import Tokenizer as RawTokenizer

    path = directory / "tokenizer.json"
    if not path.is_file():
        hint = ""
        if (directory / "tokenizer.model").is_file():
            hint = (
                " (tokenizer.model, a SentencePiece model, is not read: loading the directory with "
                "transformers' AutoTokenizer and calling save_pretrained() on it writes tokenizer.json)"
            )
        raise ModelLoadError(f"{path}: missing file{hint}")
    try:
        raw = RawTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad files
        raise ModelLoadError(f"{path}: cannot be read as a tokenizer: {e}") from None
    tok_config: dict[str, Any] = {}
    if (directory / "tokenizer_config.json").exists():
        tok_config = read_json(directory / "tokenizer_config.json")
    template, template_file = _chat_template(directory, tok_config)
    # The template's bos_token and eos_token are the tokenizer's own, as transformers renders
    # them: none declared, they are empty (they were filled from config.json's ids, and
    # --chat then built other prompt ids than apply_chat_template). As transformers 5 reads
    # them: special_tokens_map.json, where tokenizer_config.json has no added_tokens_decoder,
    # wins over tokenizer_config.json.
    special = tok_config
    if "added_tokens_decoder" not in tok_config and (directory / "special_tokens_map.json").is_file():
        special = {**tok_config, **read_json(directory / "special_tokens_map.json")}
    bos = _token_text(special.get("bos_token"))
    eos = _token_text(special.get("eos_token"))
    eos_ids = config.eos_token_ids
    eos_id = raw.token_to_id(eos) if eos is not None else None
    if not eos_ids and eos_id is not None:
        eos_ids = (int(eos_id),)
    # Added tokens past the model's embeddings: text that encodes to one is refused.
    oversized = max(raw.get_vocab(with_added_tokens=True).values(), default=0) >= config.vocab_size
    from jinja2 import TemplateError

    try:
        return HFTokenizer(
            raw,
            eos_ids,
            chat_template=template if isinstance(template, str) else None,
            bos_token=bos,
            eos_token=eos,
            vocab_limit=config.vocab_size if oversized else None,
        )
    except TemplateError as e:
        raise ModelLoadError(f"{template_file}: chat_template: {type(e).__name__}: {e}") from None


def _chat_template(directory: Path, tok_config: dict[str, Any]) -> tuple[Any, Path]:
    """The chat template (a string where there is one) and the file it came from."""
    template = tok_config.get("chat_template")
    template_file = directory / "tokenizer_config.json"
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if (directory / "chat_template.jinja").is_file():
        # As in transformers: a template file of its own wins over the entry in
        # tokenizer_config.json (an older template a checkpoint kept there built other prompts).
        template_file = directory / "chat_template.jinja"
        try:
            template = template_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{template_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return template, template_file


def load_model(source: str | Path, device: torch.device, dtype: torch.dtype | None = None) -> LoadedModel:
    """`source` is "demo" or a local Hugging Face model directory."""
    if str(source) == "demo":
        model = make_demo_model(device, dtype or torch.float32)
        return LoadedModel(model, ByteTokenizer(), DEMO_MODEL.max_position_embeddings)
    directory = Path(source)
    if not directory.is_dir():
        from tierserve.model_config import KNOWN_MODELS

        # Said for `serve`, `generate` and `bench engine` alike: only `serve` has a --backend.
        simulated = (
            f"; {source!r} names a simulated model, which has no weights: `tierserve serve --backend sim` "
            "runs it"
            if str(source).lower() in KNOWN_MODELS
            else ""
        )
        raise ModelLoadError(
            f"{directory}: not a directory (give 'demo' or a local Hugging Face model directory{simulated})"
        )
    gen_path = directory / "generation_config.json"
    gen_config = read_json(gen_path) if gen_path.exists() else None
    spec = parse_hf_config(directory / "config.json", gen_config)
    if spec.quantization is not None:  # else the tensor checks refused it, naming biases and shapes
        raise ModelLoadError(
            f"{directory / 'config.json'}: quantized weights ({spec.quantization}) are not supported: "
            "the torch executor runs float32, float16 and bfloat16 checkpoints"
        )
    if spec.context_note:
        logger.warning("%s: requests are held to %s", directory, spec.context_said())
    tokenizer = load_tokenizer(directory, spec.config)
    if dtype is None:
        # CPUs run float32 fastest and exactly; GPUs run the checkpoint's half precision.
        half = _HALF_DTYPES.get((spec.checkpoint_dtype or "").removeprefix("torch."), torch.bfloat16)
        dtype = torch.float32 if device.type == "cpu" else half
    # Names and shapes from the headers, and the room, before a byte of the model is allocated.
    with torch.device("meta"):
        shapes = {
            n: tuple(t.shape) for n, t in CausalLM(spec.config, spec.options).checkpoint_tensors().items()
        }
    files = check_tensors(directory, shapes)
    _check_room(directory / "config.json", shapes, device, dtype)
    model = _unfilled_model(spec.config, device, dtype, spec.options)
    load_weights(model, directory, files)
    if said := spec.sampling_defaults.said():
        logger.info("%s: generation_config.json's sampling defaults: %s", directory, said)
    return LoadedModel(model, tokenizer, spec.max_model_len, spec.context_note, spec.sampling_defaults)


def _check_room(
    config: Path, shapes: dict[str, tuple[int, ...]], device: torch.device, dtype: torch.dtype
) -> None:
    """Refuse weights larger than the memory free on `device` in one line, before allocating
    them (an 8 B model runs float32 on a CPU: 32 GB, and the kernel killed the process
    without a word)."""
    size = sum(math.prod(shape) for shape in shapes.values()) * torch.empty((), dtype=dtype).element_size()
    free = free_bytes(device)
    if free is not None and size > free:
        on_cpu = " (a CPU runs float32; a GPU runs the checkpoint's 16 bits)" if device.type == "cpu" else ""
        raise ModelLoadError(
            f"{config}: the weights take {size / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')} "
            f"on {device}, more than the {free / 2**30:.1f} GiB free there{on_cpu}"
        )


def free_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on `device`: a GPU's free memory; for the CPU the host's
    MemAvailable, or the room left under the process's memory cgroup where that is less (in
    a container /proc/meminfo shows the host's memory); None where it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    known = [b for b in (_mem_available(), cgroup_room()) if b is not None]
    return min(known, default=None)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a number near 2^63


def cgroup_room(root: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")) -> int | None:
    """The room left under the process's memory cgroups: at each level from its own cgroup up
    to the root that has a limit, the limit less that level's use (its children's included:
    a parent's limit binds its siblings too) but the page cache the kernel can take back
    (inactive file pages, as kubelet counts it); the least of them. None without a limit,
    or where it cannot be read. cgroup v2 (memory.max, memory.current, memory.stat) or v1
    (the `memory` controller's memory.limit_in_bytes, memory.usage_in_bytes, memory.stat)."""
    v2, v1 = _own_cgroups(own)
    rooms = _rooms(root, root / (v2 or "/").lstrip("/"), "memory.max", "memory.current", "inactive_file")
    if rooms is None:
        v1_root = root / "memory"
        folder = v1_root / (v1 or "/").lstrip("/")
        rooms = _rooms(
            v1_root, folder, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
        )
    return min(rooms) if rooms else None


def _rooms(root: Path, folder: Path, limit_file: str, used_file: str, cache_key: str) -> list[int] | None:
    """Each limited level's room from `folder` up to `root`; None where `folder` has no usage
    to read (not this cgroup version, or not visible here)."""
    if not (folder / used_file).is_file():
        if folder == root:
            return None
        folder = root  # a cgroup path this namespace does not show: the mount's root is ours
        if not (folder / used_file).is_file():
            return None
    rooms = []
    for level in [folder, *folder.parents]:
        try:
            limit_text = (level / limit_file).read_text().strip()
            used = int((level / used_file).read_text().strip())
        except (OSError, ValueError):
            limit_text, used = "max", 0
        if limit_text.isdigit() and int(limit_text) < _NO_LIMIT:
            rooms.append(max(0, int(limit_text) - used + _stat(level).get(cache_key, 0)))
        if level == root:
            break
    return rooms


def _own_cgroups(own: Path) -> tuple[str | None, str | None]:
    """The process's cgroup paths from /proc/self/cgroup: v2's ("0::PATH"), v1's memory one."""
    v2 = v1 = None
    try:
        for line in own.read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) != 3:
                continue
            number, controllers, path = parts
            if number == "0" and controllers == "":
                v2 = path
            elif "memory" in controllers.split(","):
                v1 = path
    except OSError:
        pass
    return v2, v1


def _stat(folder: Path) -> dict[str, int]:
    try:
        pairs = (line.split() for line in (folder / "memory.stat").read_text().splitlines())
        return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}
    except OSError:
        return {}
