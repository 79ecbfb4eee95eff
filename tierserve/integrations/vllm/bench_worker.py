"""One contender of `tierserve bench vllm`, run in vLLM's virtualenv:

    python -m tierserve.integrations.vllm.bench_worker --kind tierserve-plugin \\
        --model DIR --workload workload.json

Runs the workload open-loop on an in-process vLLM engine (`vllm-fcfs`, `vllm-priority` or
`tierserve-plugin`) and prints one JSON object: per request, its tier, phase, TTFT and
output tokens; per phase, the makespan; and the preemptions seen.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from tierserve.bench.vllm_bench import BenchRequest, EngineSettings, load_workload, run_open_loop

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one process: steps are driven from here

KINDS = ("vllm-fcfs", "vllm-priority", "tierserve-plugin")
PLUGIN = "tierserve.integrations.vllm.TierScheduler"


def kv_bytes_per_token(model: Path) -> int:
    """K and V of one token over all layers, in float32 (the dtype the bench runs in)."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return int(c["num_hidden_layers"] * 2 * kv_heads * head_dim * 4)


class VllmContender:
    def __init__(self, kind: str, model: Path, settings: EngineSettings) -> None:
        from vllm import LLM

        extra: dict[str, Any] = {"scheduler_cls": PLUGIN} if kind == "tierserve-plugin" else {}
        self.kind = kind
        self.llm = LLM(
            str(model),
            dtype="float32",
            block_size=settings.block_size,
            max_model_len=settings.max_model_len,
            kv_cache_memory_bytes=(settings.num_blocks + 1) * settings.block_size * kv_bytes_per_token(model),
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            scheduling_policy="priority" if kind == "vllm-priority" else "fcfs",
            enforce_eager=True,
            seed=0,
            **extra,
        )
        self.engine = self.llm.llm_engine
        self._sched = self.engine.engine_core.engine_core.scheduler
        self.preemptions: dict[str, int] = {}

    def submit(self, req: BenchRequest, arrival: float) -> None:
        from vllm import SamplingParams

        plugin = self.kind == "tierserve-plugin"
        params = SamplingParams(
            max_tokens=req.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            extra_args={"tier": f"P{req.tier}"} if plugin else None,
        )
        priority = req.tier if self.kind == "vllm-priority" else 0
        self.engine.add_request(
            req.request_id, {"prompt_token_ids": req.prompt}, params, arrival_time=arrival, priority=priority
        )

    def step(self) -> list[tuple[str, int, bool]]:
        outs = self.engine.step()
        for rid, r in self._sched.requests.items():
            if r.num_preemptions:
                self.preemptions[rid] = max(self.preemptions.get(rid, 0), r.num_preemptions)
        return [(o.request_id, len(o.outputs[0].token_ids) if o.outputs else 0, o.finished) for o in outs]

    def has_unfinished(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_worker")
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--workload", type=Path, required=True)
    args = parser.parse_args(argv)
    workload = load_workload(args.workload)
    contender = VllmContender(args.kind, args.model, workload.settings)
    result = run_open_loop(contender, workload)
    result["preemptions"] = contender.num_preemptions()
    sys.stdout.write("BENCH-RESULT " + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
