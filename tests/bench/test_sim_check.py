"""`tierserve bench sim-check` on tiny shapes: the steps the executor runs are the engine's,
the prediction is the cost model's for the same chunks, and bad settings fail clearly."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tierserve.bench import sim_check
from tierserve.clock import VirtualClock
from tierserve.config import EngineConfig, SchedulerConfig
from tierserve.engine import Engine
from tierserve.executors.base import StepBatch
from tierserve.executors.null import NullExecutor
from tierserve.executors.sim.cost_model import CostModel, SeqChunk
from tierserve.executors.sim.gpus import get_gpu
from tierserve.model_config import DEMO_MODEL
from tierserve.request import Request, SamplingParams

CPU = torch.device("cpu")
MIXED = "d2x20+p8@16"  # two decodes after 20 tokens, one chunk of 8 after 16
MIXED_CHUNKS = [SeqChunk(1, 20), SeqChunk(1, 20), SeqChunk(8, 16)]


def command(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sim_check.register(parser.add_subparsers(dest="bench", required=True))
    return parser.parse_args(["sim-check", "--threads", "1", *argv])


def signature(batch: StepBatch) -> list[tuple[Any, ...]]:
    """What the executor reads of each sequence, block ids aside."""
    return [
        (kind, s.start, s.num_tokens, s.samples, s.request.num_tokens, len(s.request.block_ids))
        for kind, seqs in (("decode", batch.decodes), ("prefill", batch.prefills))
        for s in seqs
    ]


def test_shapes_parse_into_decodes_and_prefill_chunks() -> None:
    shape = sim_check.parse_shape(MIXED)
    assert shape.chunks == MIXED_CHUNKS
    assert (shape.num_tokens, shape.max_len, shape.num_blocks(16)) == (10, 24, 6)
    assert sim_check.parse_shape("p128").chunks == [SeqChunk(128, 0)]
    for bad in ("p0", "d0x8", "d4x0", "q12", "p12+", "d4"):
        with pytest.raises(ValueError, match="shape"):
            sim_check.parse_shape(bad)


def _engine_steps(
    prompts: list[tuple[int, int]], budget: int, late: list[int]
) -> list[list[tuple[Any, ...]]]:
    """Signatures of the batches an engine hands its executor, taken as each step runs:
    (prompt tokens, max_tokens) requests, the ones whose index is in `late` added after
    the first step."""
    steps: list[list[tuple[Any, ...]]] = []
    executor = NullExecutor(
        num_device_blocks=64, num_host_blocks=0, on_execute=lambda b: steps.append(signature(b))
    )
    config = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=budget))
    engine = Engine(config, "fcfs", executor, VirtualClock())
    reqs = [
        Request(f"r{i}", [100 * i + j for j in range(n)], SamplingParams(max_tokens=m, ignore_eos=True))
        for i, (n, m) in enumerate(prompts)
    ]
    for i, req in enumerate(reqs):
        if i not in late:
            engine.add_request(req)
    engine.step()
    for i in late:
        engine.add_request(reqs[i])
    engine.run_until_done()
    return steps


def test_built_batch_is_the_one_the_engine_hands_the_executor() -> None:
    # Two prompts of 20 tokens prefill, then decode while a third prompt of 8 arrives.
    engine_mixed = _engine_steps([(20, 3), (20, 3), (8, 1)], budget=64, late=[2])[1]
    assert [kind for kind, *_ in engine_mixed] == ["decode", "decode", "prefill"]
    built = sim_check.build_batch(sim_check.parse_shape("d2x20+p8"), 16, DEMO_MODEL.vocab_size)
    assert signature(built) == engine_mixed
    # A prompt of 40 in chunks of 16: the last chunk, 8 tokens after 16 + 16.
    last_chunk = _engine_steps([(40, 1)], budget=16, late=[])[2]
    built = sim_check.build_batch(sim_check.parse_shape("p8@32"), 16, DEMO_MODEL.vocab_size)
    assert signature(built) == last_chunk
    # Each request holds blocks of its own.
    mixed = sim_check.build_batch(sim_check.parse_shape(MIXED), 16, DEMO_MODEL.vocab_size)
    blocks = [b for s in mixed.seqs for b in s.request.block_ids]
    assert sorted(blocks) == list(range(6))


def test_prediction_is_the_cost_model_for_the_same_chunks() -> None:
    cost = CostModel(get_gpu("h200"), DEMO_MODEL)
    executor = NullExecutor(num_device_blocks=16)
    shapes = [sim_check.parse_shape(s) for s in ("p8", MIXED)]
    rows = sim_check.check_shapes(executor, cost, shapes, repeats=3)
    assert [r.predicted_s for r in rows] == [cost.step_s([SeqChunk(8, 0)]), cost.step_s(MIXED_CHUNKS)]
    assert rows[1].predicted_s != cost.step_s([SeqChunk(1, 21), SeqChunk(1, 21), SeqChunk(8, 16)])
    # One warm-up and three timed runs of each step, whole.
    assert [b.num_tokens for b in executor.batches] == [8] * 4 + [10] * 4
    for r in rows:
        assert r.measured_s == executor.step_s + executor.per_token_s * r.num_tokens
        assert r.ratio == r.measured_s / r.predicted_s and len(r.runs_s) == 3
    assert (rows[1].num_seqs, rows[1].num_tokens) == (3, 10)


def test_torch_executor_runs_exactly_the_shapes_tokens() -> None:
    torch.set_num_threads(1)
    shape = sim_check.parse_shape(MIXED)
    executor = sim_check.build_executor(DEMO_MODEL, CPU, torch.float32, shape.num_blocks(16))
    seen: list[tuple[list[int], list[int], list[int], int]] = []

    def record(_module: Any, args: tuple[Any, ...]) -> None:
        ids, positions, meta, _pool, logit_rows = args
        assert ids.numel() == positions.numel()
        seen.append((positions.tolist(), meta.slot_mapping.tolist(), logit_rows.tolist(), len(meta.prefills)))

    executor.model.register_forward_pre_hook(record)
    cost = CostModel(get_gpu("h200"), DEMO_MODEL)
    (row,) = sim_check.check_shapes(executor, cost, [shape], repeats=2)
    # Decodes at position 20 in blocks 1 and 3; the chunk's positions 16-23 in its second block (5).
    expected = ([20, 20, *range(16, 24)], [20, 52, *range(80, 88)], [0, 1, 9], 1)
    assert seen == [expected] * 3
    assert row.measured_s > 0 and row.predicted_s == cost.step_s(MIXED_CHUNKS)


def test_command_writes_every_figure_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim-check.json"
    args = command("--shape", "p8", "--shape", MIXED, "--repeats", "2", "--out", str(out), "--json")
    assert args.func(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert res == json.loads(out.read_text())
    assert (res["model"], res["device"], res["dtype"], res["gpu"], res["repeats"]) == (
        "demo",
        "cpu",
        "float32",
        "h200",
        2,
    )
    cost = CostModel(get_gpu("h200"), DEMO_MODEL)
    assert [r["shape"] for r in res["rows"]] == ["p8", MIXED]
    assert [r["predicted_s"] for r in res["rows"]] == [cost.step_s([SeqChunk(8)]), cost.step_s(MIXED_CHUNKS)]
    for r in res["rows"]:
        assert r["measured_s"] > 0 and len(r["runs_s"]) == 2
        assert r["ratio"] == r["measured_s"] / r["predicted_s"]
    assert res["median_ratio"] == pytest.approx((res["rows"][0]["ratio"] + res["rows"][1]["ratio"]) / 2)
    assert "h200" in res["notes"][0]  # a CPU is not the GPU the prediction is for
    assert isinstance(res["host"]["busy"], bool)  # a busy host is named, as `bench engine` names it


def test_torch_runs_on_one_thread_unless_told_otherwise() -> None:
    """torch's default (a thread a core) made steps 25-125x as long on a busy 2-core host."""
    parser = argparse.ArgumentParser()
    sim_check.register(parser.add_subparsers(dest="bench", required=True))
    assert parser.parse_args(["sim-check"]).threads == 1
    assert parser.parse_args(["sim-check", "--threads", "0"]).threads == 0


def test_table_says_the_prediction_is_for_the_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    args = command("--shape", "d1x4", "--repeats", "1", "--gpu", "a100-80gb", "--out", "")
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "d1x4" in text and "median measured / predicted" in text
    assert "note: the prediction is for an a100-80gb" in text
    assert not list(tmp_path.iterdir())  # --out "": no file


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-9"], "unknown model 'llama-9'; known models: demo, llama-3.1-70b, llama-3.1-8b"),
        (["--gpu", "b300"], "unknown GPU 'b300'; known GPUs: a100-80gb, h100-80gb, h200"),
        (["--shape", "p4097"], "shape 'p4097' reaches 4097 tokens; demo holds at most 4096"),
        (["--device", "mps"], "device must be cpu or cuda"),
    ],
)
def test_bad_settings_fail_clearly(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = command(*argv, "--out", "")
    assert args.func(args) == 2
    assert message in capsys.readouterr().err


def test_zero_repeats_is_refused_before_anything_is_built() -> None:
    """The CLI's --repeats refuses 0 as it is parsed; the function, for its other callers."""
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        sim_check.checked_setup(repeats=0)


def test_cuda_without_cuda_fails_clearly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = command("--device", "cuda", "--out", "")
    assert args.func(args) == 2
    assert "--device cuda asked for, but this torch" in capsys.readouterr().err


def test_a_bad_shape_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        command("--shape", "d8")
    assert "cannot read 'd8'" in capsys.readouterr().err


def test_a_shape_beyond_free_memory_fails_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sim_check, "_available_bytes", lambda _device: 3 << 30)
    with pytest.raises(ValueError, match=r"demo in float32 needs .* GiB free: give fewer decodes"):
        sim_check.checked_setup(shapes=[sim_check.parse_shape("d4096x4000")])


def test_weights_beyond_free_memory_ask_for_a_smaller_model_not_smaller_shapes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # llama-3.1-8b in float32 on a CPU with 22 GiB free said "give fewer decodes", which cannot help.
    monkeypatch.setattr(sim_check, "_available_bytes", lambda _device: 20 << 30)
    with pytest.raises(
        ValueError, match=r"weights alone do not fit: give a smaller --model or --dtype bfloat16"
    ):
        sim_check.measure(
            sim_check.checked_setup(model="llama-3.1-8b", shapes=[sim_check.parse_shape("p16")])
        )


def test_a_model_directory_is_timed_with_its_own_biases_and_norms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Qwen3 directory was timed as a plain Llama: no q/k norms, which its steps compute."""
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "torch_dtype": "float32",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    setup = sim_check.checked_setup(model=str(tmp_path), shapes=[sim_check.parse_shape("p16")], repeats=1)
    built: list[Any] = []

    def build(*args: Any, **kwargs: Any) -> Any:
        built.append(executor := sim_check_build(*args, **kwargs))
        return executor

    sim_check_build = sim_check.build_executor
    monkeypatch.setattr(sim_check, "build_executor", build)
    torch.set_num_threads(1)
    sim_check.measure(setup)
    (executor,) = built
    assert any(name.endswith("q_norm.weight") for name in executor.model.checkpoint_tensors())
    assert sim_check.checked_setup(model="demo", shapes=[sim_check.parse_shape("p16")]).options is None
