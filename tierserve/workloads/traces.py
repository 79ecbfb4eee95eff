"""Loaders for public request traces (sizes and arrival times only, no text).

- CSV, told apart by the header (columns by name, in any order, others read past):
  - Azure LLM inference trace: `TIMESTAMP,ContextTokens,GeneratedTokens`, wall-clock
    timestamps such as ``2023-11-16 18:17:03.9799600``;
  - BurstGPT: `Timestamp` (seconds), `Request tokens`, `Response tokens` (its `Model`,
    `Total tokens` and `Log Type` are read past).
- Mooncake trace (JSON lines): `timestamp` (ms; arrivals count from the first row's, so
  epoch milliseconds load too), `input_length`, `output_length`,
  `hash_ids` (one id per 512-token prefix block; the last block may be partial). A trace
  of the same shape without `hash_ids` loads too: its prompts share no prefixes.

Either may be gzip-compressed (`.csv.gz`, `.jsonl.gz`). A malformed row raises
`TraceFormatError` naming the file and the line; rows past `max_rows` are not read. A
parsed file is kept (by path, size, modification time and row limit), so the cells of a
bench that replay one trace parse it once.
"""

from __future__ import annotations

import csv
import difflib
import gzip
import json
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from tierserve.data_dir import find_data_dir
from tierserve.workloads.tokens import TRACE_BLOCK_TOKENS

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MAX_HASH_ID = (1 << 64) - 1  # hash ids become unsigned 64-bit keys (workloads/tokens.py)


class TraceFormatError(ValueError):
    """A trace file is malformed; the message starts with ``file:line:``."""


TRACE_SUFFIXES = (".csv", ".jsonl", ".json")  # CSV (Azure, BurstGPT); Mooncake JSON lines
# A Mooncake trace whose rows come this close together (mean gap) likely has its
# timestamps in seconds, not milliseconds: the replay would send them all at once.
_SUSPICIOUS_GAP_MS = 10.0  # over 100 requests/s read as ms; Mooncake's own run at 1-6
_MIN_ROWS_TO_JUDGE = 10  # fewer rows may well come that close, in either unit
# A first timestamp in these ranges is an epoch clock in another unit than the loader reads:
# epoch seconds (2001-2286) where milliseconds are read, epoch microseconds where milliseconds
# are, epoch milliseconds or microseconds where seconds are (BurstGPT's column).
_EPOCH_S = (1e9, 1e10)
_EPOCH_MS = (1e12, 1e13)
_EPOCH_US = (1e15, 1e16)
# The longest span of arrivals a replay takes: past it float seconds keep too few digits for
# a step's milliseconds, and no request trace covers it.
MAX_SPAN_S = 10 * 365 * 86_400.0
# The most tokens a row may count: past every model's context by far (a 401-digit count
# was read, and overflowed a float in `bench engine` far from the file).
MAX_TOKEN_COUNT = 2**31 - 1
# Parsed files kept up to this many rows in all, the oldest dropped first (a bench reads
# each file several times; at 4 files, six traces in one run were parsed 6-7 times each,
# their warnings repeated). The newest file stays whatever its size.
_CACHE_ROWS = 1_000_000

log = logging.getLogger(__name__)
_cache: dict[tuple[str, int, int, int | None], list[TraceRecord]] = {}


@dataclass(frozen=True, slots=True)
class TraceRecord:
    arrival_s: float  # from the first row of the trace
    num_prompt_tokens: int
    num_output_tokens: int  # may be 0 in a trace; the replay asks for at least 1
    hash_ids: tuple[int, ...] = ()  # prefix blocks, empty when the trace has none
    line: int = 0


def _shown(value: Any, limit: int = 40) -> str:
    """`value` as an error quotes it, cut short: a prompt's text in a count's column made a
    12 KB error line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words (a `null` line read as "NoneType")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    kinds = ((list, "an array"), (str, "a string"), ((int, float), "a number"))
    return next((name for t, name in kinds if isinstance(value, t)), type(value).__name__)


def _count(where: str, name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(f"{where}: {name} must be an integer, got {_shown(value)}")
    if value < minimum:
        raise TraceFormatError(f"{where}: {name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise TraceFormatError(f"{where}: {name} must be <= {maximum}, got {value}")
    return value


def _int_field(where: str, name: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceFormatError(f"{where}: {name} must be an integer, got {_shown(text)}") from None
    return _count(where, name, value, minimum, MAX_TOKEN_COUNT)


def _check_order(where: str, stamp: object, arrival_s: float, previous_s: float) -> None:
    if arrival_s < previous_s:
        raise TraceFormatError(
            f"{where}: timestamp {stamp} goes back in time ({arrival_s:.3f} s from the first row, the "
            f"row before at {previous_s:.3f} s): rows must be in arrival order; sort the file by timestamp"
        )


@contextmanager
def _open_text(p: Path, newline: str | None = None) -> Iterator[IO[str]]:
    """The file as text, gunzipped where its name ends in .gz; a BOM at the start is skipped
    (a spreadsheet's export may start with one)."""
    if _gzipped(p):
        with gzip.open(p, "rt", encoding="utf-8-sig", newline=newline) as f:
            yield f
    else:
        with p.open(encoding="utf-8-sig", newline=newline) as f:
            yield f


@dataclass(frozen=True)
class CsvLayout:
    """A CSV trace's columns, found by name in its header (any order; other columns are
    read past): arrival time, prompt and output tokens."""

    name: str
    timestamp: str
    prompt: str
    output: str
    dates: bool  # wall-clock dates (Azure); else seconds from any origin (BurstGPT)
    skips_empty_prompts: bool = False


CSV_LAYOUTS = (
    CsvLayout("the Azure LLM inference trace", *AZURE_COLUMNS, dates=True),
    # BurstGPT logs failed requests with 0 response tokens (kept: the replay asks for 1) and
    # some with 0 request tokens, which no engine can serve (skipped, with a warning).
    CsvLayout(
        "BurstGPT", "Timestamp", "Request tokens", "Response tokens", dates=False, skips_empty_prompts=True
    ),
)


def _csv_layout(p: Path, header: list[str] | None) -> tuple[CsvLayout, tuple[int, int, int]]:
    """The layout whose three columns the header names (case and spaces aside), and where."""
    names = [h.strip().lower() for h in header or ()]
    for layout in CSV_LAYOUTS:
        wanted = (layout.timestamp, layout.prompt, layout.output)
        if all(w.lower() in names for w in wanted):
            twice = [w for w in wanted if names.count(w.lower()) > 1]
            if twice:  # the first was read, without a word, whichever the file meant
                raise TraceFormatError(f"{p}:1: the header names the column {twice[0]!r} more than once")
            ts, prompt, output = (names.index(w.lower()) for w in wanted)
            return layout, (ts, prompt, output)
    got = "nothing" if header is None else repr(",".join(header))
    expected = "; ".join(
        f"{layout.name}'s {layout.timestamp},{layout.prompt},{layout.output}" for layout in CSV_LAYOUTS
    )
    raise TraceFormatError(
        f"{p}:1: expected a header with the columns of {expected}; got {got} "
        "(other CSV layouts need converting to one of these)"
    )


def _date_clock(layout: CsvLayout) -> Callable[[str, str], float]:
    """Seconds from the first row's wall-clock date, for each row's (where, stamp)."""
    first: list[datetime] = []

    def since_first(where: str, text: str) -> float:
        try:
            stamp = datetime.fromisoformat(text)
        except ValueError:
            shown = _shown(text)
            raise TraceFormatError(f"{where}: {layout.timestamp} {shown} is not a date and time") from None
        if not first:
            first.append(stamp)
        try:
            return (stamp - first[0]).total_seconds()
        except TypeError:  # one of the two has a UTC offset, the other not
            raise TraceFormatError(
                f"{where}: {layout.timestamp} {text!r} and the first row's {first[0].isoformat()!r} "
                "must both have a UTC offset or both have none"
            ) from None

    return since_first


def _seconds_clock(layout: CsvLayout) -> Callable[[str, str], float]:
    """Seconds from the first row's, for stamps that are seconds from any origin."""
    first: list[float] = []

    def since_first(where: str, text: str) -> float:
        try:
            stamp = float(text)
        except ValueError:
            stamp = math.nan
        if not math.isfinite(stamp):
            raise TraceFormatError(
                f"{where}: {layout.timestamp} must be a number of seconds, got {_shown(text)}"
            )
        if not first:
            first.append(stamp)
        return stamp - first[0]

    return since_first


def load_csv(path: str | Path, max_rows: int | None = None) -> list[TraceRecord]:
    """A CSV trace in one of `CSV_LAYOUTS`, told apart by its header; arrivals count from
    the first row."""
    p = Path(path)
    records: list[TraceRecord] = []
    num_empty = 0
    with _open_text(p, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        layout, (ts_col, prompt_col, output_col) = _csv_layout(p, header)
        num_columns = len(header or ())
        arrival = _date_clock(layout) if layout.dates else _seconds_clock(layout)
        min_prompt = 0 if layout.skips_empty_prompts else 1
        first_stamp = ""
        for start, row in _rows(p, reader):
            if len(records) == max_rows:
                break
            where = f"{p}:{start}"
            if not row or (len(row) == 1 and not row[0].strip()):  # blank, or only spaces
                continue
            if len(row) != num_columns:
                raise TraceFormatError(f"{where}: expected {num_columns} columns, got {len(row)}")
            num_prompt = _int_field(where, layout.prompt, row[prompt_col], min_prompt)
            num_output = _int_field(where, layout.output, row[output_col], 0)
            if num_prompt == 0:  # read past, as if absent: arrivals count from the first row kept
                num_empty += 1
                continue
            stamp = row[ts_col].strip()
            arrival_s = arrival(where, stamp)
            if not records:
                first_stamp = stamp  # the first kept row's: the epoch check reads it
            _check_order(where, repr(stamp), arrival_s, records[-1].arrival_s if records else 0.0)
            records.append(TraceRecord(arrival_s, num_prompt, num_output, line=start))
    if num_empty:
        rows = "row" if num_empty == 1 else "rows"
        log.warning("%s: skipped %d %s with 0 %s (nothing to serve)", p, num_empty, rows, layout.prompt)
    if not records:
        skipped = f" (the {num_empty} there had 0 {layout.prompt})" if num_empty else ""
        raise TraceFormatError(f"{p}: no rows{skipped}")
    if not layout.dates:
        _warn_if_epoch(
            p, float(first_stamp), "seconds", (("milliseconds", _EPOCH_MS), ("microseconds", _EPOCH_US))
        )
    _warn_if_no_output(p, records, layout.output)
    return records


def _rows(p: Path, reader: Any) -> Iterator[tuple[int, list[str]]]:
    """Each record of a CSV reader with the line it starts on (a quoted field may run over
    several lines: the reader's line number is its last). A record the csv module cannot
    read (a stray quote that runs to the end of a large file) is a TraceFormatError naming
    where it starts, not an unexpected failure."""
    start = reader.line_num + 1
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise TraceFormatError(
                f"{p}:{start}: not CSV the loader can read ({e}; a stray quote?)"
            ) from None
        yield start, row
        start = reader.line_num + 1


def load_mooncake_jsonl(path: str | Path, max_rows: int | None = None) -> list[TraceRecord]:
    p = Path(path)
    records: list[TraceRecord] = []
    origin_ms: float | None = None
    unread: dict[str, str | None] = {}  # keys of the rows that are not MOONCAKE_KEYS
    with _open_text(p) as f:
        for line_no, line in enumerate(f, start=1):
            if len(records) == max_rows:
                break
            if not line.strip():
                continue
            where = f"{p}:{line_no}"
            stamp, num_prompt, num_output, hash_ids = _mooncake_row(where, line, unread)
            if origin_ms is None:
                origin_ms = stamp  # arrivals count from the first row (a trace may carry epoch ms)
            arrival_s = (stamp - origin_ms) / 1000.0
            _check_order(where, f"{stamp!r} ms", arrival_s, records[-1].arrival_s if records else 0.0)
            records.append(TraceRecord(arrival_s, num_prompt, num_output, hash_ids, line=line_no))
    if not records:
        raise TraceFormatError(f"{p}: no rows")
    if unread:  # a `tier` column, say, that a user may think sets the tier (--tier-mix does)
        shown = ", ".join(repr(k) for k in sorted(unread)[:8])
        log.warning("%s: keys not read: %s (read: %s)", p, shown, ", ".join(MOONCAKE_KEYS))
    if origin_ms is not None:
        _warn_if_epoch(p, origin_ms, "milliseconds", (("seconds", _EPOCH_S), ("microseconds", _EPOCH_US)))
    _warn_if_seconds(p, records)
    _warn_if_no_output(p, records, "output_length")
    return records


MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


def _check_keys(where: str, row: dict[str, object], unread: dict[str, str | None]) -> None:
    """The three keys a row needs; a key that looks like a misspelt one of MOONCAKE_KEYS the
    row lacks (`hash_id`, `input_lenght`) is refused: read as an unknown key it was ignored,
    and with it every prefix the trace shares. Other keys go into `unread`, each with the key
    it resembles (judged once a key, for the whole file; the loader warns of them once)."""
    for key in row:
        if key in MOONCAKE_KEYS:
            continue
        if key not in unread:
            close = difflib.get_close_matches(key, MOONCAKE_KEYS, n=1, cutoff=0.8)
            # A key that extends one (`hash_ids_len`) is a field of its own, not a misspelling.
            unread[key] = close[0] if close and not key.startswith(close[0] + "_") else None
        resembles = unread[key]
        if resembles is not None and resembles not in row:
            raise TraceFormatError(f"{where}: unknown key {_shown(key)} (did you mean {resembles!r}?)")
    for key in MOONCAKE_KEYS[:3]:
        if key not in row:
            raise TraceFormatError(f"{where}: missing {key!r} (keys read: {', '.join(MOONCAKE_KEYS)})")


def _mooncake_row(
    where: str, line: str, unread: dict[str, str | None]
) -> tuple[float, int, int, tuple[int, ...]]:
    """One JSON line's (timestamp in ms, input length, output length, hash ids), checked."""
    lines_hint = "the file must be JSON lines: one object per line"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceFormatError(
            f"{where}: invalid JSON ({e.msg.removesuffix(' at')} at column {e.colno}; {lines_hint})"
        ) from None
    except RecursionError:
        raise TraceFormatError(f"{where}: JSON nested too deeply ({lines_hint})") from None
    except ValueError as e:  # an integer past Python's digit limit
        raise TraceFormatError(f"{where}: invalid JSON ({e})") from None
    if not isinstance(row, dict):
        got = _json_kind(row)
        raise TraceFormatError(f"{where}: expected a JSON object, got {got} ({lines_hint})")
    _check_keys(where, row, unread)
    stamp = row["timestamp"]
    # An int too large for a float failed `math.isfinite` with an OverflowError; comparing
    # an int with a float is exact, and NaN fails it too.
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not 0 <= stamp < 1e300:
        raise TraceFormatError(
            f"{where}: timestamp must be a number of ms, >= 0 and < 1e300, got {_shown(stamp)}"
        )
    num_prompt = _count(where, "input_length", row["input_length"], 1, MAX_TOKEN_COUNT)
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
    num_output = _count(where, "output_length", row["output_length"], 0, MAX_TOKEN_COUNT)
    return stamp, num_prompt, num_output, tuple(hash_ids)


_UNIT_S = {"seconds": 1.0, "milliseconds": 1e-3, "microseconds": 1e-6}


def _warn_if_epoch(
    p: Path, first: float, read_as: str, others: Sequence[tuple[str, tuple[float, float]]]
) -> None:
    """A first timestamp that is an epoch clock in another unit (`others`: each unit with
    the range its clock is in these centuries) replays the trace 1000 times too fast or
    too slow."""
    for unit, (low, high) in others:
        if low <= first < high:
            ratio = _UNIT_S[unit] / _UNIT_S[read_as]  # > 1: read as a smaller unit, too fast
            fix = f"multiply them by {ratio:.0f}" if ratio > 1 else f"divide them by {1 / ratio:.0f}"
            log.warning(
                "%s: the first timestamp, %.17g, looks like an epoch clock in %s, and this format's are "
                "read as %s (the replay would run %.0f times too %s): %s",
                p,
                first,
                unit,
                read_as,
                max(ratio, 1 / ratio),
                "fast" if ratio > 1 else "slow",
                fix,
            )
            return


def _warn_if_no_output(p: Path, records: list[TraceRecord], name: str) -> None:
    """Rows with 0 output tokens are served as 1 (a request's first token is its output):
    said, as a row cut to the context is, since such requests are not quite the trace's."""
    num_none = sum(r.num_output_tokens == 0 for r in records)
    if num_none:
        rows = "row has" if num_none == 1 else "rows have"
        log.warning("%s: %d %s 0 %s: each is served as 1 output token", p, num_none, rows, name)


def _warn_if_seconds(p: Path, records: list[TraceRecord]) -> None:
    """Timestamps in seconds read as milliseconds put a whole trace into an instant. Judged
    by the mean gap, not the median: traces stamped to the whole second (Mooncake's) have
    most rows at the same instant as the row before."""
    if len(records) < _MIN_ROWS_TO_JUDGE or records[-1].arrival_s == 0:
        return  # too few to judge, or all at one instant (as a burst may be, in either unit)
    mean_ms = records[-1].arrival_s / (len(records) - 1) * 1000.0
    if mean_ms < _SUSPICIOUS_GAP_MS:
        log.warning(
            "%s: %d rows arrive over %.3f s (%.3f ms apart on average): its timestamps are read as "
            "milliseconds; if they are seconds, multiply them by 1000",
            p,
            len(records),
            records[-1].arrival_s,
            mean_ms,
        )


def span_s(records: Sequence[TraceRecord]) -> float:
    """Seconds from the first row's arrival to the last's (0 for none)."""
    return records[-1].arrival_s - records[0].arrival_s if records else 0.0


def span_line(path: Path, records: Sequence[TraceRecord]) -> str:
    """What a replay read, in one line: rows, their span and rate at 1x, and the token
    counts. The unit of a trace's timestamps cannot always be told from them (seconds read
    as Mooncake's milliseconds replay a sparse trace a thousand times too fast), nor a
    column read in another's place from the row count: this line shows both."""
    span = span_s(records)
    rate = f"{(len(records) - 1) / span:.4g} requests/s" if span > 0 else "all at one instant"
    rows = f"{len(records):,} row{'' if len(records) == 1 else 's'}"
    line = f"{path}: {rows} arriving over {span:,.6g} s ({rate} at 1x)"
    if not records:
        return line
    prompts = [r.num_prompt_tokens for r in records]
    outputs = [r.num_output_tokens for r in records]
    return f"{line}; prompt tokens {_spread(prompts)}; output tokens {_spread(outputs)}"


def _spread(counts: Sequence[int]) -> str:
    """Mean, median and largest of a column of token counts, as a person checks a file's."""
    mean = sum(counts) / len(counts)
    median = sorted(counts)[len(counts) // 2]
    return f"mean {mean:,.1f}, median {median:,}, max {max(counts):,}"


def _days(seconds: float) -> str:
    """Days to a tenth, as digits up to a million (a span just past the limit read "10 years;
    at most 10"); beyond, in powers of ten."""
    days = seconds / 86_400
    return f"{days:,.1f} days" if days < 1e6 else f"{days:.3g} days"


def check_span(path: Path, records: Sequence[TraceRecord], scale: float = 1.0) -> None:
    """Refuse a trace spanning more than MAX_SPAN_S at `scale` times its rate: one row a
    lifetime later (a timestamp of 1e308 s) ran, and its times lost all their digits (a
    request with a TTFT of 0 that never completed)."""
    scaled_s = span_s(records) / scale
    if scaled_s > MAX_SPAN_S:
        at = f" at {scale:g} times its rate" if scale != 1.0 else ""
        said, limit = _days(scaled_s), _days(MAX_SPAN_S)
        if said == limit:  # just past it: in seconds, to the digit that differs
            digits = 0
            while digits < 9 and f"{scaled_s:,.{digits}f}" == f"{MAX_SPAN_S:,.{digits}f}":
                digits += 1
            said, limit = f"{scaled_s:,.{digits}f} s", f"{MAX_SPAN_S:,.{digits}f} s"
        raise TraceFormatError(
            f"{path}: its rows span {said}{at}; at most {limit} (check the timestamps' unit, or the speed-up)"
        )


def trace_suffix(path: Path) -> str | None:
    """The trace format's suffix (".csv", ".jsonl" or ".json"), past a ".gz"; None if neither."""
    name = path.name.lower().removesuffix(".gz")
    return next((s for s in TRACE_SUFFIXES if name.endswith(s)), None)


def in_data_folder(path: Path) -> str:
    """Where a trace named by a bare file name is in the data folder, for the error that it
    is not here: a path is read as given, from the current folder, and docs that named a
    trace by its file name left a new user at "no such trace file"."""
    root = find_data_dir()
    if path.parent != Path(".") or root is None or not (root / path.name).is_file():
        return ""
    return f" here (a path is read from the current folder; the data folder has {root / path.name})"


def load_trace(path: str | Path, max_rows: int | None = None) -> list[TraceRecord]:
    """Pick the loader by extension: .csv (Azure or BurstGPT, by its header) or .jsonl
    (Mooncake), either gzipped or not; read at most `max_rows` rows. A new list each call
    (of the rows parsed once)."""
    p = Path(path)
    if p.is_dir():
        raise TraceFormatError(f"{p}: a folder, not a trace file")
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such trace file{in_data_folder(p)}")
    if not p.is_file():
        raise TraceFormatError(f"{p}: not a regular file (a trace is read from a file)")
    suffix = trace_suffix(p)
    if suffix is None:
        raise TraceFormatError(
            f"{p}: unknown trace format (expected .csv, or .jsonl / .json lines; either may be .gz)"
        )
    if not _gzipped(p) and _starts_as_gzip(p):
        raise TraceFormatError(f"{p}: gzip data in a file not named .gz: name it {p.name}.gz")
    stat = p.stat()
    key = (str(p.resolve()), stat.st_size, stat.st_mtime_ns, max_rows)
    cached = _cache.get(key)
    if cached is None:
        try:
            loader = load_csv if suffix == ".csv" else load_mooncake_jsonl
            cached = loader(p, max_rows)
        except UnicodeDecodeError as e:
            # e.start counts from the decoder's chunk, not the file's start: name the line.
            raise TraceFormatError(f"{p}:{_first_line_not_utf8(p)}: not UTF-8 text ({e.reason})") from None
        except (gzip.BadGzipFile, EOFError) as e:
            raise TraceFormatError(f"{p}: not a readable gzip file ({e})") from None
        check_span(p, cached)
        _cache[key] = cached
        while sum(map(len, _cache.values())) > _CACHE_ROWS and len(_cache) > 1:
            del _cache[next(iter(_cache))]
    return list(cached)


def _gzipped(p: Path) -> bool:
    """Whether `p` is named as gzip-compressed (and so read through gzip)."""
    return p.name.lower().endswith(".gz")


def _starts_as_gzip(p: Path) -> bool:
    with p.open("rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _first_line_not_utf8(p: Path) -> int:
    """The number of the first line of `p` (gunzipped where named .gz) that is not UTF-8."""
    opener = gzip.open if _gzipped(p) else open
    with opener(p, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return line_no
    return 1  # not reached: the text reader failed somewhere
