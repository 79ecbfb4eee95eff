"""Loaders for public request traces (sizes and arrival times only, no text).

- Azure LLM inference trace (CSV): `TIMESTAMP,ContextTokens,GeneratedTokens`, wall-clock
  timestamps such as ``2023-11-16 18:17:03.9799600``.
- Mooncake trace (JSON lines): `timestamp` (ms; arrivals count from the first row's, so
  epoch milliseconds load too), `input_length`, `output_length`,
  `hash_ids` (one id per 512-token prefix block; the last block may be partial). A trace
  of the same shape without `hash_ids` loads too: its prompts share no prefixes.

A malformed row raises `TraceFormatError` naming the file and the line.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tierserve.workloads.tokens import TRACE_BLOCK_TOKENS

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MAX_HASH_ID = (1 << 64) - 1  # hash ids become unsigned 64-bit keys (workloads/tokens.py)


class TraceFormatError(ValueError):
    """A trace file is malformed; the message starts with ``file:line:``."""


TRACE_SUFFIXES = (".csv", ".jsonl", ".json")  # Azure CSV; Mooncake JSON lines (either name)


@dataclass(frozen=True, slots=True)
class TraceRecord:
    arrival_s: float  # from the first row of the trace
    num_prompt_tokens: int
    num_output_tokens: int  # may be 0 in a trace; the replay asks for at least 1
    hash_ids: tuple[int, ...] = ()  # prefix blocks, empty when the trace has none
    line: int = 0


def _count(where: str, name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(f"{where}: {name} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceFormatError(f"{where}: {name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise TraceFormatError(f"{where}: {name} must be <= {maximum}, got {value}")
    return value


def _int_field(where: str, name: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceFormatError(f"{where}: {name} must be an integer, got {text!r}") from None
    return _count(where, name, value, minimum)


def _check_order(where: str, arrival_s: float, previous_s: float) -> None:
    if arrival_s < previous_s:
        raise TraceFormatError(
            f"{where}: timestamp goes back in time ({arrival_s:.3f} s < {previous_s:.3f} s)"
        )


def load_azure_csv(path: str | Path) -> list[TraceRecord]:
    p = Path(path)
    records: list[TraceRecord] = []
    with p.open(newline="", encoding="utf-8-sig") as f:  # a spreadsheet's export may start with a BOM
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != AZURE_COLUMNS:
            raise TraceFormatError(f"{p}:1: expected the header {','.join(AZURE_COLUMNS)}, got {header!r}")
        origin: datetime | None = None
        for row in reader:
            where = f"{p}:{reader.line_num}"
            if not row or (len(row) == 1 and not row[0].strip()):  # blank, or only spaces
                continue
            if len(row) != len(AZURE_COLUMNS):
                raise TraceFormatError(f"{where}: expected {len(AZURE_COLUMNS)} columns, got {len(row)}")
            try:
                stamp = datetime.fromisoformat(row[0].strip())
            except ValueError:
                raise TraceFormatError(f"{where}: TIMESTAMP {row[0]!r} is not a date and time") from None
            origin = origin or stamp
            try:
                arrival_s = (stamp - origin).total_seconds()
            except TypeError:  # one of the two has a UTC offset, the other not
                raise TraceFormatError(
                    f"{where}: TIMESTAMP {row[0].strip()!r} and the first row's {origin.isoformat()!r} "
                    "must both have a UTC offset or both have none"
                ) from None
            _check_order(where, arrival_s, records[-1].arrival_s if records else 0.0)
            records.append(
                TraceRecord(
                    arrival_s,
                    _int_field(where, "ContextTokens", row[1], 1),
                    _int_field(where, "GeneratedTokens", row[2], 0),
                    line=reader.line_num,
                )
            )
    if not records:
        raise TraceFormatError(f"{p}: no rows")
    return records


def load_mooncake_jsonl(path: str | Path) -> list[TraceRecord]:
    p = Path(path)
    records: list[TraceRecord] = []
    origin_ms: float | None = None
    with p.open(encoding="utf-8-sig") as f:  # a BOM, as the CSV loader takes it
        for line_no, line in enumerate(f, start=1):
            where = f"{p}:{line_no}"
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise TraceFormatError(f"{where}: expected a JSON object")
            for key in ("timestamp", "input_length", "output_length"):
                if key not in row:
                    raise TraceFormatError(f"{where}: missing {key!r}")
            stamp = row["timestamp"]
            if (
                isinstance(stamp, bool)
                or not isinstance(stamp, (int, float))
                or not math.isfinite(stamp)
                or stamp < 0
            ):
                raise TraceFormatError(f"{where}: timestamp must be a number of ms >= 0, got {stamp!r}")
            num_prompt = _count(where, "input_length", row["input_length"], 1)
            hash_ids = row.get("hash_ids")
            if hash_ids is None:
                hash_ids = []
            elif not isinstance(hash_ids, list):
                raise TraceFormatError(f"{where}: hash_ids must be a list")
            for h in hash_ids:
                _count(where, "each hash id", h, 0, MAX_HASH_ID)
            num_blocks = -(-num_prompt // TRACE_BLOCK_TOKENS)
            if hash_ids and len(hash_ids) != num_blocks:
                raise TraceFormatError(
                    f"{where}: input_length {num_prompt} needs {num_blocks} hash ids "
                    f"of {TRACE_BLOCK_TOKENS} tokens, got {len(hash_ids)}"
                )
            if origin_ms is None:
                origin_ms = stamp  # arrivals count from the first row (a trace may carry epoch ms)
            arrival_s = (stamp - origin_ms) / 1000.0
            _check_order(where, arrival_s, records[-1].arrival_s if records else 0.0)
            records.append(
                TraceRecord(
                    arrival_s,
                    num_prompt,
                    _count(where, "output_length", row["output_length"], 0),
                    tuple(hash_ids),
                    line=line_no,
                )
            )
    if not records:
        raise TraceFormatError(f"{p}: no rows")
    return records


def load_trace(path: str | Path) -> list[TraceRecord]:
    """Pick the loader by extension: .csv (Azure) or .jsonl (Mooncake)."""
    p = Path(path)
    if p.is_dir():
        raise TraceFormatError(f"{p}: a folder, not a trace file")
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such trace file")
    suffix = p.suffix.lower()
    if suffix not in TRACE_SUFFIXES:
        raise TraceFormatError(f"{p}: unknown trace format (expected .csv, or .jsonl / .json lines)")
    try:
        return load_azure_csv(p) if suffix == ".csv" else load_mooncake_jsonl(p)
    except UnicodeDecodeError as e:
        raise TraceFormatError(f"{p}: not UTF-8 text (byte {e.start}: {e.reason})") from None
