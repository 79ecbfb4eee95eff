"""Fixtures for the PyTorch executor tests: tiny checkpoints written on the fly, no network."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
# Tiny models gain nothing from threads, and spinning threads crawl on a shared CPU.
torch.set_num_threads(1)

# The helper modules beside this file, importable whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).parent))

from torch_checkpoints import Checkpoint, write_checkpoint  # noqa: E402


@pytest.fixture
def make_checkpoint(tmp_path: Path) -> Callable[..., Checkpoint]:
    counter = iter(range(1000))

    def make(**kwargs: Any) -> Checkpoint:
        return write_checkpoint(tmp_path / f"ckpt{next(counter)}", **kwargs)

    return make


@pytest.fixture
def checkpoint(make_checkpoint: Callable[..., Checkpoint]) -> Checkpoint:
    return make_checkpoint()
