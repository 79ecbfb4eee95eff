"""Named errors for broken scheduling invariants (never `assert`, which `python -O` drops)."""

from __future__ import annotations


class SchedulingError(RuntimeError):
    """A scheduling invariant does not hold: a bug, never an expected outcome."""


class EmptyQueueError(SchedulingError, IndexError):
    """`pop` was called on a queue with nothing the policy may serve."""


class PolicyOrderError(SchedulingError):
    """A policy's `pop` returned another request than its `peek` just did."""


class LifecycleError(SchedulingError):
    """A request is not in the state its transition needs (e.g. finishing one not running)."""
