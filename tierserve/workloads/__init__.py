"""Benchmark workloads: synthetic mixed-tier traffic, trace replay and arrival processes."""

from tierserve.workloads.arrivals import arrival_times, with_arrivals
from tierserve.workloads.lengths import DEFAULT_SHAPES, ConversationShape, LengthDist, TierShape
from tierserve.workloads.presets import PRESETS, WorkloadPreset, get_preset
from tierserve.workloads.spec import RequestSpec, TierMix, cap_lengths
from tierserve.workloads.synthetic import synthetic_stream
from tierserve.workloads.trace_stream import TIER_ASSIGNMENT_RULE, trace_stream
from tierserve.workloads.traces import TraceFormatError, TraceRecord, load_trace

__all__ = [
    "DEFAULT_SHAPES",
    "PRESETS",
    "TIER_ASSIGNMENT_RULE",
    "ConversationShape",
    "LengthDist",
    "RequestSpec",
    "TierMix",
    "TierShape",
    "TraceFormatError",
    "TraceRecord",
    "WorkloadPreset",
    "arrival_times",
    "cap_lengths",
    "get_preset",
    "load_trace",
    "synthetic_stream",
    "trace_stream",
    "with_arrivals",
]
