"""Where the public request traces and measured GPU profiles are: the folder named by
$TIERSERVE_DATA, else `shared/data` beside the repository. They are not in the repository;
docs/data.md says what they are and how to get them."""

from __future__ import annotations

import os
from pathlib import Path

DATA_ENV = "TIERSERVE_DATA"
REPO = Path(__file__).resolve().parents[1]
BESIDE_REPO = REPO.parent / "shared" / "data"
HOW_TO_GET = (
    f"the data folder (traces and GPU profiles) is not present: set {DATA_ENV} to a folder that "
    f"holds it, or put it at {BESIDE_REPO}; docs/data.md says what it holds and where to get it"
)


class DataNotFoundError(FileNotFoundError):
    """The data folder, or a file in it, is not where tierserve looks."""


def find_data_dir() -> Path | None:
    """$TIERSERVE_DATA when it is set (even to a missing folder, so a typo is not hidden by
    the fallback), else `shared/data` beside the repository; None when that is not a folder."""
    named = os.environ.get(DATA_ENV)
    candidate = Path(named).expanduser() if named else BESIDE_REPO
    return candidate if candidate.is_dir() else None


def data_path(*parts: str) -> Path:
    """A file or folder inside the data folder; DataNotFoundError saying how to get it if absent."""
    root = find_data_dir()
    if root is None:
        named = os.environ.get(DATA_ENV)
        if named:  # set, to a folder that is not there: the typo is the news
            raise DataNotFoundError(f"{DATA_ENV} is set to {named}, which is not a folder; docs/data.md")
        raise DataNotFoundError(HOW_TO_GET)
    path = root.joinpath(*parts)
    if not path.exists():
        raise DataNotFoundError(f"{path} is missing from the data folder {root}; see docs/data.md")
    return path
