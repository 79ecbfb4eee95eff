"""What `tierserve serve --backend` builds: an executor, its tokenizer and the model's name.

`torch` runs a real model (the built-in demo model or a local Hugging Face directory).
`sim` is a time-faithful twin of a real deployment: the executor predicts each step's
duration for the named model on `tp` GPUs, the server sleeps that long (`pace`), and
the tokens are placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tierserve.executors.base import Executor
from tierserve.server.tokenizer import PlaceholderTokenizer, Tokenizer

DEFAULT_SIM_MODEL = "llama-3.1-70b"
DEFAULT_SIM_GPU = "a100-80gb"  # as --gpu takes it
DEFAULT_SIM_TP = 8


@dataclass(frozen=True)
class Backend:
    executor: Executor
    tokenizer: Tokenizer
    model_name: str
    vocab_size: int
    pace: bool  # sleep the executor's predicted durations (simulated time made real)


class BackendError(Exception):
    """The backend cannot be built; the message says why."""


@dataclass(frozen=True)
class BackendSpec:
    """A backend to build later, in the engine process (picklable: names, not objects)."""

    kind: str
    model: str | None = None
    gpu: str | None = None
    tp: int | None = None
    device: str = "cpu"
    kv_cache_bytes: int | None = None  # torch: the K/V cache's size (None: the executor's default)

    def __call__(self) -> Backend:
        return build_backend(
            self.kind,
            self.model,
            gpu=self.gpu,
            tp=self.tp,
            device=self.device,
            kv_cache_bytes=self.kv_cache_bytes,
        )


def build_backend(
    kind: str,
    model: str | None,
    *,
    gpu: str | None = None,
    tp: int | None = None,
    device: str = "cpu",
    kv_cache_bytes: int | None = None,
) -> Backend:
    if kind == "torch":
        return _torch_backend(model or "demo", device, kv_cache_bytes)
    if kind == "sim":
        return _sim_backend(model or DEFAULT_SIM_MODEL, gpu or DEFAULT_SIM_GPU, tp or DEFAULT_SIM_TP)
    raise BackendError(f"--backend: unknown backend {kind!r} (torch or sim)")


def _torch_backend(model: str, device: str, kv_cache_bytes: int | None = None) -> Backend:
    try:
        from tierserve.executors.pytorch.executor import build_torch_executor
        from tierserve.executors.pytorch.hf_config import ModelLoadError
    except ImportError as e:  # pragma: no cover - torch is a dependency
        raise BackendError(f"the torch backend is unavailable: {e}") from None
    try:
        executor, tokenizer = build_torch_executor(model, device=device, kv_cache_bytes=kv_cache_bytes)
    except (ModelLoadError, OSError, ValueError) as e:
        raise BackendError(f"--model {model}: {e}") from None
    # The directory's own name, also for `.` or `..` (whose `Path.name` is empty or `..`:
    # a model no request could name).
    name = "demo" if model == "demo" else (Path(model).resolve().name or "model")
    return Backend(executor, tokenizer, name, executor.model.config.vocab_size, pace=False)


def _does_not_fit(model: str, gpu: str, tp: int) -> str | None:
    """`tierserve profile`'s verdict where the weights leave no room for the K/V cache: it
    names the smallest --tp that fits. None for any other fault (an unknown GPU, a --tp that
    does not divide the model)."""
    from tierserve.executors.sim.profile_cli import does_not_fit, profile

    try:
        return does_not_fit(profile(model, gpu, tp))
    except ValueError:
        return None


def _sim_backend(model: str, gpu: str, tp: int) -> Backend:
    try:
        from tierserve.executors.sim import build_sim_executor, get_model
    except ImportError as e:  # pragma: no cover - part of the package
        raise BackendError(f"the sim backend is unavailable: {e}") from None
    try:
        config = get_model(model)
    except ValueError as e:
        raise BackendError(f"--model: {e}") from None
    try:
        executor = build_sim_executor(config.name, gpu, tp)
    except ValueError as e:
        raise BackendError(_does_not_fit(config.name, gpu, tp) or f"--gpu {gpu} --tp {tp}: {e}") from None
    return Backend(
        executor, PlaceholderTokenizer(config.vocab_size), config.name, config.vocab_size, pace=True
    )
