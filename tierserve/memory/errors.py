"""The error a broken KV-cache invariant raises (a bug in tierserve, never a client's fault).

A named exception rather than `assert`: `python -O` removes asserts, and a pool that has
lost track of a block must stop the engine, not serve one request another's KV.
"""

from __future__ import annotations


class KVIntegrityError(RuntimeError):
    """A block is lost, doubled, mis-counted or mis-indexed."""
