from __future__ import annotations

import gzip
import logging
from pathlib import Path

import pytest

from tierserve.workloads.traces import TraceFormatError, load_csv, load_mooncake_jsonl, load_trace, span_line

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_azure_rows_become_arrivals_from_the_first_row(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "a.csv",
        AZURE_HEADER + "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:05.4799600,110,0\n",
    )
    records = load_csv(path)
    assert [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in records] == [
        (0.0, 4808, 10),
        (pytest.approx(1.5), 110, 0),
    ]
    assert records[1].line == 3


def test_rows_with_no_output_are_served_as_one_token_and_said_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A trace whose every output length was 0 ran as one of 1-token outputs, with nothing
    said in the terminal or the report, while a prompt of 0 is refused."""
    azure = write(
        tmp_path,
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.0,4808,0\n2023-11-16 18:17:04.0,12,3\n2023-11-16 18:17:05.0,50,0\n",
    )
    mooncake = write(tmp_path, "m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 0}\n')
    with caplog.at_level(logging.WARNING):
        assert [r.num_output_tokens for r in load_csv(azure)] == [0, 3, 0]
        load_mooncake_jsonl(mooncake)
    assert "2 rows have 0 GeneratedTokens: each is served as 1 output token" in caplog.text
    assert "1 row has 0 output_length" in caplog.text


@pytest.mark.parametrize(
    "row, message",
    [
        ("2023-11-16 18:17:04.0,12\n", "expected 3 columns"),
        ("yesterday,12,3\n", "TIMESTAMP"),
        ("2023-11-16 18:17:04.0,twelve,3\n", "ContextTokens must be an integer"),
        ("2023-11-16 18:17:04.0,0,3\n", "ContextTokens must be >= 1"),
        ("2023-11-16 18:17:04.0,12,-3\n", "GeneratedTokens must be >= 0"),
        # a 401-digit count was read, and overflowed a float in `bench engine`, far from the file
        ("2023-11-16 18:17:04.0,1" + "0" * 400 + ",3\n", "ContextTokens must be <= 2147483647"),
        ("2023-11-16 18:17:02.0,12,3\n", "back in time"),
        ("2023-11-16 18:17:04.0+00:00,12,3\n", "both have a UTC offset or both have none"),
    ],
)
def test_azure_malformed_row_names_file_and_line(tmp_path: Path, row: str, message: str) -> None:
    path = write(tmp_path, "a.csv", AZURE_HEADER + "2023-11-16 18:17:03.0,5,5\n" + row)
    with pytest.raises(TraceFormatError, match=message) as err:
        load_csv(path)
    assert str(err.value).startswith(f"{path}:3:")


def test_azure_csv_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    path = tmp_path / "bom.csv"
    path.write_text(AZURE_HEADER + "2023-11-16 18:17:03.0,5,5\n", encoding="utf-8-sig")
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in load_csv(path)] == [(5, 5)]


def test_a_csv_of_no_known_layout_is_line_1_naming_the_layouts(tmp_path: Path) -> None:
    with pytest.raises(
        TraceFormatError,
        match=r"a\.csv:1: expected a header with the columns of the Azure LLM inference trace's "
        r"TIMESTAMP,ContextTokens,GeneratedTokens; BurstGPT's Timestamp,Request tokens,Response tokens; "
        r"got 'time,in,out'",
    ):
        load_csv(write(tmp_path, "a.csv", "time,in,out\n"))


BURSTGPT_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def test_burstgpt_rows_become_arrivals_in_seconds_from_the_first_row(tmp_path: Path) -> None:
    """BurstGPT's release: seconds, two columns read past between the counts, failed
    requests with 0 response tokens (kept, as Azure's 0 outputs are)."""
    path = write(
        tmp_path,
        "burst.csv",
        BURSTGPT_HEADER
        + "5,ChatGPT,472,18,490,Conversation log\n"
        + "45,ChatGPT,1087,230,1317,Conversation log\n"
        + "118.5,GPT-4,417,0,417,API log\n",
    )
    records = load_trace(path)
    assert [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens, r.line) for r in records] == [
        (0.0, 472, 18, 2),
        (40.0, 1087, 230, 3),
        (113.5, 417, 0, 4),
    ]


def test_csv_columns_are_found_by_name_in_any_order(tmp_path: Path) -> None:
    """An export that reorders the columns (or changes their case) reads the same rows."""
    reordered = write(
        tmp_path,
        "b.csv",
        "Log Type,timestamp,Request Tokens,Response tokens,Total tokens,Model\n"
        + "Conversation log,5,472,18,490,ChatGPT\nAPI log,45,1087,230,1317,GPT-4\n",
    )
    assert [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in load_trace(reordered)] == [
        (0.0, 472, 18),
        (40.0, 1087, 230),
    ]
    azure = write(
        tmp_path,
        "a.csv",
        "GeneratedTokens,TIMESTAMP,ContextTokens,service\n10,2023-11-16 18:17:03.0,4808,x\n",
    )
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in load_trace(azure)] == [(4808, 10)]


def test_burstgpt_rows_without_request_tokens_are_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing can serve an empty prompt; the rows around it load, and arrivals count from
    the first row kept."""
    path = write(
        tmp_path,
        "burst.csv",
        BURSTGPT_HEADER
        + "3,ChatGPT,0,0,0,API log\n"
        + "5,ChatGPT,472,18,490,Conversation log\n"
        + "7,ChatGPT,0,12,12,API log\n"
        + "9,GPT-4,10,2,12,API log\n",
    )
    with caplog.at_level(logging.WARNING):
        records = load_csv(path)
    assert [(r.arrival_s, r.num_prompt_tokens) for r in records] == [(0.0, 472), (4.0, 10)]
    assert "skipped 2 rows with 0 Request tokens" in caplog.text


@pytest.mark.parametrize(
    "row, message",
    [
        ("soon,ChatGPT,10,2,12,API log\n", "Timestamp must be a number of seconds, got 'soon'"),
        ("nan,ChatGPT,10,2,12,API log\n", "Timestamp must be a number of seconds"),
        ("7,ChatGPT,-1,2,12,API log\n", "Request tokens must be >= 0"),
        ("7,ChatGPT,10,2.5,12,API log\n", "Response tokens must be an integer"),
        ("7,ChatGPT,10,2\n", "expected 6 columns, got 4"),
        ("4,ChatGPT,10,2,12,API log\n", "back in time"),
    ],
)
def test_burstgpt_malformed_row_names_file_and_line(tmp_path: Path, row: str, message: str) -> None:
    path = write(tmp_path, "b.csv", BURSTGPT_HEADER + "5,ChatGPT,472,18,490,Conversation log\n" + row)
    with pytest.raises(TraceFormatError, match=message) as err:
        load_trace(path)
    assert str(err.value).startswith(f"{path}:3:")


def test_mooncake_rows_keep_hash_ids_and_ms_timestamps(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "m.jsonl",
        '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}\n'
        '\n{"timestamp": 2500, "input_length": 512, "output_length": 1, "hash_ids": [0]}\n',
    )
    records = load_mooncake_jsonl(path)
    assert records[0].hash_ids == (0, 1) and records[1].arrival_s == 2.5 and records[1].line == 3


def test_mooncake_rows_without_hash_ids_share_no_prefix(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "m.jsonl",
        '{"timestamp": 0, "input_length": 600, "output_length": 5}\n'
        '{"timestamp": 10, "input_length": 7, "output_length": 2, "hash_ids": null}\n',
    )
    records = load_mooncake_jsonl(path)
    assert [(r.num_prompt_tokens, r.hash_ids) for r in records] == [(600, ()), (7, ())]


@pytest.mark.parametrize(
    "row, message",
    [
        ("{not json", "invalid JSON"),
        # The message named no place ("Invalid control character at;").
        (
            '{"timestamp": 1, "input_length": "a\x01b"}',
            "Invalid control character at column 36;",
        ),
        ("[1, 2]", "expected a JSON object, got an array"),
        ("null", "expected a JSON object, got null"),  # it said "NoneType"
        ('"row"', "expected a JSON object, got a string"),
        ('{"timestamp": 1, "input_length": 10, "hash_ids": [1]}', "missing 'output_length'"),
        ('{"timestamp": "x", "input_length": 10, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        (
            '{"timestamp": 1, "input_length": 10.5, "output_length": 1, "hash_ids": [1]}',
            "input_length must be an integer",
        ),
        ('{"timestamp": 1, "input_length": 1000, "output_length": 1, "hash_ids": [1]}', "needs 2 hash ids"),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [-4]}',
            "hash id must be >= 0",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": 4}',
            "hash_ids must be a list",
        ),
        # A misspelt key was ignored: the trace replayed with no shared prefix, or it said only "missing"
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_id": [1]}',
            "unknown key 'hash_id' .did you mean 'hash_ids'.",
        ),
        ('{"timestamp": 1, "input_lenght": 10, "output_length": 1}', "unknown key 'input_lenght' .did you"),
        # An int too large for a float raised OverflowError; past Python's digit limit a
        # ValueError that named neither file nor line.
        ('{"timestamp": 1' + "0" * 400 + ', "input_length": 10, "output_length": 1}', "timestamp must be"),
        ('{"timestamp": 1, "input_length": 1' + "0" * 5000 + ', "output_length": 1}', "invalid JSON"),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 1' + "0" * 12 + "}",
            "output_length must be <=",
        ),
    ],
)
def test_mooncake_malformed_row_names_file_and_line(tmp_path: Path, row: str, message: str) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
    path = write(tmp_path, "m.jsonl", good + good + row + "\n")
    with pytest.raises(TraceFormatError, match=message) as err:
        load_mooncake_jsonl(path)
    assert str(err.value).startswith(f"{path}:3:")


def test_load_trace_picks_the_format_by_extension(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        load_trace(write(tmp_path, "t.txt", "x"))
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.csv")


def test_the_shared_traces_load(shared_data: Path) -> None:
    azure = load_trace(shared_data / "AzureLLMInferenceTrace_code.csv")
    mooncake = load_trace(shared_data / "mooncake_conversation_trace.jsonl")
    assert len(azure) == 8819 and len(mooncake) == 12031
    assert azure[-1].arrival_s == pytest.approx(3435.948056)
    assert all(len(r.hash_ids) == -(-r.num_prompt_tokens // 512) for r in mooncake)


def test_mooncake_epoch_millisecond_timestamps_count_from_the_first_row(tmp_path: Path) -> None:
    rows = [
        f'{{"timestamp": {1_700_000_000_000 + ms}, "input_length": 10, "output_length": 2}}'
        for ms in (0, 250, 4000)
    ]
    records = load_mooncake_jsonl(write(tmp_path, "epoch.jsonl", "\n".join(rows) + "\n"))
    assert [r.arrival_s for r in records] == [0.0, 0.25, 4.0]


def test_mooncake_hash_ids_must_fit_in_64_bits(tmp_path: Path) -> None:
    row = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [%d]}\n'
    assert load_mooncake_jsonl(write(tmp_path, "ok.jsonl", row % (2**64 - 1)))[0].hash_ids == (2**64 - 1,)
    with pytest.raises(TraceFormatError, match=r"big\.jsonl:1: each hash id must be <="):
        load_mooncake_jsonl(write(tmp_path, "big.jsonl", row % 2**64))


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("t.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.1,\xff,5\n"),
        ("t.jsonl", b'{"timestamp": 0, "input_length": 10, "output_length": 5}\n\xff\xfe\n'),
    ],
)
def test_a_trace_that_is_not_utf8_names_its_file(tmp_path: Path, name: str, data: bytes) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(TraceFormatError, match=f"{path}:2: not UTF-8 text"):
        load_trace(path)


def test_what_the_csv_loader_takes_the_jsonl_loader_takes_too(tmp_path: Path) -> None:
    """A byte order mark (the CSV loader took it, the JSONL one called it invalid JSON), a line
    of spaces (skipped like an empty one, not "expected 3 columns, got 1"), and an upper-case
    extension (refused as an unknown format)."""
    bom = tmp_path / "bom.jsonl"
    bom.write_text('{"timestamp": 0, "input_length": 5, "output_length": 5}\n', encoding="utf-8-sig")
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in load_trace(bom)] == [(5, 5)]
    spaced = write(tmp_path, "SPACED.CSV", AZURE_HEADER + "2023-11-16 18:17:03.0,5,5\n   \n")
    assert [r.num_prompt_tokens for r in load_trace(spaced)] == [5]


def test_a_folder_named_as_a_trace_is_called_a_folder(tmp_path: Path) -> None:
    from tierserve.workloads import get_preset

    folder = tmp_path / "t.csv"
    folder.mkdir()
    with pytest.raises(TraceFormatError, match="a folder, not a trace file"):
        load_trace(folder)
    with pytest.raises(ValueError, match="a folder, not a trace file"):
        get_preset(str(folder))


@pytest.mark.parametrize(
    ("last_s", "said"),
    [
        # a row at 1e308 s ran, and its times had no digits left for a step's milliseconds
        ("1e308", r"span 1.16e\+303 days; at most 3,650.0 days"),
        # just past the limit it read "its rows span 10 years; at most 10"
        (f"{3651 * 86_400}", r"span 3,651.0 days; at most 3,650.0 days"),
        (f"{3650 * 86_400 + 7}", r"span 315,360,007 s; at most 315,360,000 s"),
        (f"{3650 * 86_400 + 0.4}", r"span 315,360,000.4 s; at most 315,360,000.0 s"),
    ],
)
def test_a_trace_spanning_more_than_ten_years_is_refused(tmp_path: Path, last_s: str, said: str) -> None:
    far = write(tmp_path, "far.csv", BURSTGPT_HEADER + "0,ChatGPT,5,5,10,Conversation log\n")
    far.write_text(far.read_text() + f"{last_s},ChatGPT,5,5,10,Conversation log\n")
    with pytest.raises(TraceFormatError, match=said):
        load_trace(far)


def test_a_device_named_as_a_trace_is_not_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="not a regular file"):
        load_trace("/dev/null")


def test_a_csv_header_naming_a_column_twice_is_refused(tmp_path: Path) -> None:
    twice = write(tmp_path, "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens,contexttokens\n")
    with pytest.raises(TraceFormatError, match="names the column 'ContextTokens' more than once"):
        load_trace(twice)


def test_a_json_line_nested_too_deeply_is_a_format_error(tmp_path: Path) -> None:
    deep = write(tmp_path, "d.jsonl", "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(TraceFormatError, match="nested too deeply"):
        load_trace(deep)


MOONCAKE_ROW = '{"timestamp": %s, "input_length": 10, "output_length": 5}\n'


def test_gzipped_traces_load_as_the_plain_ones(tmp_path: Path) -> None:
    csv_text = AZURE_HEADER + "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:05.4799600,110,0\n"
    jsonl_text = MOONCAKE_ROW % 0 + MOONCAKE_ROW % 250
    for name, text in (("a.csv", csv_text), ("b.jsonl", jsonl_text)):
        plain = write(tmp_path, name, text)
        zipped = tmp_path / (name + ".GZ")  # any case, as the plain suffixes
        zipped.write_bytes(gzip.compress(text.encode()))
        assert load_trace(zipped) == load_trace(plain)
    broken = tmp_path / "c.csv.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(TraceFormatError, match=r"c\.csv\.gz: not a readable gzip file"):
        load_trace(broken)


def test_max_rows_reads_no_further(tmp_path: Path) -> None:
    """A bench replaying the first rows of a large trace neither parses the rest nor stops
    on a bad row beyond them."""
    rows = "".join(f"2023-11-16 18:17:{i:02d}.0,100,10\n" for i in range(5))
    path = write(tmp_path, "a.csv", AZURE_HEADER + rows + "not a row\n")
    assert len(load_trace(path, max_rows=5)) == 5
    with pytest.raises(TraceFormatError, match=r"a\.csv:7"):
        load_trace(path)
    jsonl = write(tmp_path, "b.jsonl", MOONCAKE_ROW % 0 + MOONCAKE_ROW % 1 + "{broken\n")
    assert [r.line for r in load_trace(jsonl, max_rows=2)] == [1, 2]


def test_a_trace_is_parsed_once_and_each_caller_gets_its_own_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierserve.workloads import traces

    path = write(tmp_path, "a.jsonl", MOONCAKE_ROW % 0 + MOONCAKE_ROW % 5)
    calls: list[Path] = []
    real = traces.load_mooncake_jsonl

    def counting(p: Path, max_rows: int | None = None) -> list[traces.TraceRecord]:
        calls.append(p)
        return real(p, max_rows)

    monkeypatch.setattr(traces, "load_mooncake_jsonl", counting)
    first = load_trace(path)
    first.clear()  # a caller's change stays its own
    assert len(load_trace(path)) == 2 and len(calls) == 1
    path.write_text(MOONCAKE_ROW % 0)  # a changed file is read again
    assert len(load_trace(path)) == 1 and len(calls) == 2


def test_unsorted_rows_say_which_timestamp_and_how_to_fix_it(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", MOONCAKE_ROW % 5000 + MOONCAKE_ROW % 4000)
    with pytest.raises(TraceFormatError, match=r"a\.jsonl:2: timestamp 4000 ms goes back .* sort the file"):
        load_trace(path)


@pytest.mark.parametrize(
    "text",
    ['[{"timestamp": 0, "input_length": 10, "output_length": 5}]\n', '{\n  "timestamp": 0\n}\n'],
    ids=["array", "indented"],
)
def test_json_that_is_not_json_lines_says_so(tmp_path: Path, text: str) -> None:
    with pytest.raises(TraceFormatError, match="one object per line"):
        load_trace(write(tmp_path, "a.json", text))


def test_seconds_read_as_milliseconds_are_warned_of(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seconds = write(tmp_path, "s.jsonl", "".join(MOONCAKE_ROW % (i * 0.5) for i in range(200)))
    with caplog.at_level(logging.WARNING, logger="tierserve.workloads.traces"):
        load_trace(seconds)
    assert "multiply them by 1000" in caplog.text
    caplog.clear()
    millis = write(tmp_path, "ms.jsonl", "".join(MOONCAKE_ROW % (i * 500) for i in range(200)))
    # Stamped to the whole second, in ms, as Mooncake's: most rows share the one before's.
    whole_seconds = write(tmp_path, "w.jsonl", "".join(MOONCAKE_ROW % (i // 10 * 1000) for i in range(200)))
    # All at one instant, as a burst may be: no unit would spread it (the advice was wrong).
    instant = write(tmp_path, "i.jsonl", MOONCAKE_ROW % 7 * 200)
    with caplog.at_level(logging.WARNING, logger="tierserve.workloads.traces"):
        load_trace(millis)
        load_trace(whole_seconds)
        load_trace(instant)
    assert caplog.text == ""


def _warnings(caplog: pytest.LogCaptureFixture, path: Path) -> str:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tierserve.workloads.traces"):
        load_trace(path)
    return caplog.text


def test_a_short_trace_or_an_epoch_clock_in_the_wrong_unit_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Judged only from 100 rows on (so a --max-requests under 100 hid it), and an epoch
    clock 2 s apart read as 2 ms was never judged at all: the trace ran 1000 times too fast
    (or, BurstGPT in milliseconds, too slow) without a word."""
    seconds = write(tmp_path, "s.jsonl", "".join(MOONCAKE_ROW % (i * 0.3) for i in range(20)))
    assert "multiply them by 1000" in _warnings(caplog, seconds)
    epoch_s = write(tmp_path, "e.jsonl", "".join(MOONCAKE_ROW % (1.7e9 + 2 * i) for i in range(20)))
    assert "epoch clock in seconds" in _warnings(caplog, epoch_s)
    assert "multiply them by 1000" in caplog.text
    epoch_us = write(tmp_path, "u.jsonl", "".join(MOONCAKE_ROW % (1.7e15 + 2e6 * i) for i in range(3)))
    assert "divide them by 1000" in _warnings(caplog, epoch_us)
    rows = "".join(f"{1.7e12 + 300 * i:.0f},ChatGPT,472,18,490,Conversation log\n" for i in range(5))
    burst_ms = write(tmp_path, "b.csv", BURSTGPT_HEADER + rows)
    assert "epoch clock in milliseconds" in _warnings(caplog, burst_ms)
    assert "divide them by 1000" in caplog.text
    # In their own units: no word.
    epoch_ms = write(tmp_path, "m.jsonl", "".join(MOONCAKE_ROW % (1.7e12 + 2000 * i) for i in range(20)))
    rows_s = "".join(f"{1.7e9 + 0.3 * i:.1f},ChatGPT,472,18,490,Conversation log\n" for i in range(5))
    burst_s = write(tmp_path, "bs.csv", BURSTGPT_HEADER + rows_s)
    assert _warnings(caplog, epoch_ms) == "" and _warnings(caplog, burst_s) == ""


def test_a_stray_quote_names_the_line_its_record_starts_on(tmp_path: Path) -> None:
    """The record runs to the end of the file: a small one was blamed on its last line, a
    large one escaped as csv.Error ("field larger than field limit"), an unexpected failure."""
    good = "2023-11-16 18:17:03.9799600,10,2\n"
    small = write(tmp_path, "small.csv", AZURE_HEADER + good * 5 + '2023-11-16 18:17:04,"10,2\n' + good * 200)
    with pytest.raises(TraceFormatError, match=r"small\.csv:7: expected 3 columns"):
        load_trace(small)
    large = write(
        tmp_path, "large.csv", AZURE_HEADER + good * 5 + '2023-11-16 18:17:04,"10,2\n' + good * 5000
    )
    with pytest.raises(TraceFormatError, match=r"large\.csv:7: not CSV the loader can read .*stray quote"):
        load_trace(large)


def test_bytes_that_are_not_utf8_name_their_line(tmp_path: Path) -> None:
    """The byte offset given was inside the decoder's chunk (byte 2574 of a file whose bad
    byte was at 150,030)."""
    good = b"2023-11-16 18:17:03.9799600,10,2\n"
    path = tmp_path / "t.csv"
    path.write_bytes(AZURE_HEADER.encode() + good * 5000 + b"2023-11-16 18:17:04,1\xe9,2\n" + good)
    with pytest.raises(TraceFormatError, match=r"t\.csv:5002: not UTF-8 text"):
        load_trace(path)


def test_gzip_data_under_a_plain_name_says_to_name_it_gz(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_bytes(gzip.compress((AZURE_HEADER + "2023-11-16 18:17:03,10,2\n").encode()))
    with pytest.raises(TraceFormatError, match=r"gzip data .* name it t\.csv\.gz"):
        load_trace(path)


def test_mooncake_keys_that_are_not_read_are_warned_of_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A `tier` key does not set the tier (--tier-mix draws it): it was ignored without a word."""
    # `hash_ids_len` extends a key rather than misspelling it: a field of its own, read as none.
    row = '{"timestamp": %d, "input_length": 10, "output_length": 1, "tier": "P0", "hash_ids_len": 1}\n'
    path = write(tmp_path, "m.jsonl", "".join(row % t for t in range(3)))
    with caplog.at_level(logging.WARNING, logger="tierserve.workloads.traces"):
        assert len(load_mooncake_jsonl(path)) == 3
    assert caplog.text.count("keys not read: 'hash_ids_len', 'tier' (read: timestamp,") == 1


def test_the_span_line_says_what_a_replay_read(tmp_path: Path) -> None:
    """Seconds read as Mooncake's milliseconds replay a sparse trace 1000 times too fast,
    and nothing in the rows can tell: the commands print this line so that it shows."""
    rows = "".join(f'{{"timestamp": {t}, "input_length": 10, "output_length": 1}}\n' for t in (0, 300, 600))
    path = write(tmp_path, "seconds.jsonl", rows)
    assert span_line(path, load_trace(path)).startswith(
        f"{path}: 3 rows arriving over 0.6 s (3.333 requests/s at 1x); "
    )
    # The token columns too, as a person checks them against the file (a trial had to).
    mixed = "".join(
        f'{{"timestamp": {t}, "input_length": {n}, "output_length": {m}}}\n'
        for t, n, m in ((0, 10, 0), (1, 20, 5), (2, 60, 7))
    )
    path = write(tmp_path, "mixed.jsonl", mixed)
    assert span_line(path, load_trace(path)).endswith(
        "; prompt tokens mean 30.0, median 20, max 60; output tokens mean 4.0, median 5, max 7"
    )
    one = write(tmp_path, "one.jsonl", '{"timestamp": 5, "input_length": 10, "output_length": 1}\n')
    assert "1 row arriving over 0 s (all at one instant" in span_line(one, load_trace(one))


def test_seconds_at_one_request_a_second_read_as_milliseconds_are_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only traces over 1,000 requests/s (read as ms) were flagged: a seconds trace at about 1
    a second replayed 1,000 times too fast without a word. Real ms traces run at 1-6 a second."""
    seconds = write(tmp_path, "s.jsonl", "".join(MOONCAKE_ROW % (i * 1.0) for i in range(300)))
    assert "multiply them by 1000" in _warnings(caplog, seconds)
    busy_ms = write(tmp_path, "ms.jsonl", "".join(MOONCAKE_ROW % (i * 50) for i in range(300)))  # 20/s
    assert _warnings(caplog, busy_ms) == ""


@pytest.mark.parametrize("cell", ["x" * 12_000, "9" * 5_000 + ".5"])
def test_an_error_quotes_a_long_cell_cut_short(tmp_path: Path, cell: str) -> None:
    """A prompt's text in a count's column made a 12 KB error line."""
    path = write(tmp_path, "b.csv", BURSTGPT_HEADER + f"5,ChatGPT,{cell},18,490,Conversation log\n")
    with pytest.raises(TraceFormatError) as err:
        load_trace(path)
    message = str(err.value)
    assert "Request tokens must be an integer" in message and len(message) < 200, message
    assert f"({len(repr(cell))} characters)" in message


def test_a_csv_whose_every_row_has_no_prompt_says_so(tmp_path: Path) -> None:
    path = write(tmp_path, "b.csv", BURSTGPT_HEADER + "3,ChatGPT,0,0,0,API log\n" * 50)
    with pytest.raises(TraceFormatError, match=r"no rows \(the 50 there had 0 Request tokens\)"):
        load_trace(path)


def test_a_run_of_six_traces_parses_each_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A bench reads each trace several times (setup, capacity, cells): with four files kept,
    # six traces read in turn were parsed again at every read, their warnings repeated.
    from tierserve.workloads import traces

    parsed: list[str] = []

    def counting(path: Path, max_rows: int | None = None) -> list[traces.TraceRecord]:
        parsed.append(path.name)
        return load_csv(path, max_rows)

    monkeypatch.setattr(traces, "load_csv", counting)
    monkeypatch.setattr(traces, "_cache", {})
    files = []
    for i in range(6):
        f = tmp_path / f"t{i}.csv"
        f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,10,3\n")
        files.append(f)
    for _ in range(3):
        for f in files:
            assert len(load_trace(f)) == 1
    assert sorted(parsed) == [f.name for f in files]
