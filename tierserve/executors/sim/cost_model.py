"""Predicts how long one engine step takes for a named GPU, model and tensor-parallel degree.

Per transformer layer, on each of the `tp` GPUs (the GPUs run in lockstep):
  * linear layers (QKV, output, gate+up, down): 2 FLOPs per weight per token, weights and
    activations read once; time = max(FLOPs / (peak × eff(tokens)), bytes / (HBM × mem_eff))
    plus a fixed cost per GEMM kernel;
  * attention over the context: QKᵀ and AV, 4 × head_dim FLOPs per (query, key) pair (causal
    inside a prefill chunk), the K/V of the whole context read and the new K/V written;
  * element-wise kernels (residual add + RMSNorm twice, RoPE, SiLU×mul): memory traffic only;
  * two all-reduces of the hidden states (after attention and after the MLP), ring algorithm.
Once per step: the LM head for the last position of every sequence, and the engine's CPU
overhead. `roofline_s` is the same work at 100 % of every peak with no fixed costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tierserve.executors.sim.gpus import GiB, GpuProfile
from tierserve.model_config import ModelConfig

DEFAULT_ACTIVATION_RESERVE_BYTES = 2 * GiB  # per GPU: activation peak + CUDA/NCCL context (estimate)
LOGIT_BYTES = 4  # logits are computed in float32
GEMMS_PER_LAYER = 4  # QKV, output projection, gate+up, down
PARTS_MEMO_SIZE = 1 << 14  # (tokens, sequences) pairs whose costs `CostModel` keeps


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's share of a step: `num_tokens` new tokens after `num_context_tokens` cached ones."""

    num_tokens: int
    num_context_tokens: int = 0


class _Parts(NamedTuple):
    """The terms of a step's cost that do not depend on its attention (see `CostModel._cost`)."""

    linear_s: float
    elementwise_s: float
    lm_head_s: float
    allreduce_s: float
    linear_roofline_s: float  # of one layer
    elementwise_roofline_s: float
    lm_head_roofline_s: float
    comm_roofline_s: float


@dataclass(frozen=True, slots=True)
class StepCost:
    """Predicted seconds of one step, by part, and the roofline lower bound."""

    linear_s: float
    attention_s: float
    elementwise_s: float
    lm_head_s: float
    allreduce_s: float
    overhead_s: float
    roofline_s: float

    @property
    def total_s(self) -> float:
        return (
            self.linear_s
            + self.attention_s
            + self.elementwise_s
            + self.lm_head_s
            + self.allreduce_s
            + self.overhead_s
        )


def gemm_s(gpu: GpuProfile, flops: float, num_bytes: float, num_tokens: int, num_kernels: int) -> float:
    """Matrix multiplies over `num_tokens` rows: the slower of compute and memory, plus launch costs."""
    eff = gpu.efficiency
    compute = flops / (gpu.peak_flops * eff.compute_eff(num_tokens))
    memory = num_bytes / (gpu.hbm_bytes_per_s * eff.mem_eff)
    return max(compute, memory) + num_kernels * eff.kernel_fixed_s


class CostModel:
    """Step times, K/V sizes and capacity for `model` split over `tp` GPUs of kind `gpu`."""

    def __init__(self, gpu: GpuProfile, model: ModelConfig, tp: int = 1) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        kv = model.num_key_value_heads
        if model.num_attention_heads % tp or model.intermediate_size % tp or (kv % tp and tp % kv):
            raise ValueError(
                f"tp={tp} does not divide {model.name}'s {model.num_attention_heads} attention heads, "
                f"{kv} KV heads (or a multiple of them) and intermediate size {model.intermediate_size}"
            )
        self.gpu = gpu
        self.model = model
        self.tp = tp
        d, h = model.head_size, model.hidden_size
        self.q_dim = model.num_attention_heads // tp * d  # per GPU
        self.kv_dim = max(1, kv // tp) * d  # per GPU; KV heads are replicated when tp > kv heads
        i = model.intermediate_size // tp
        self.linear_weights = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + 2 * h * i + i * h
        # Inputs and outputs of the four GEMMs, elements per token.
        self.linear_act = (h + self.q_dim + 2 * self.kv_dim) + (self.q_dim + h) + (h + 2 * i) + (i + h)
        # Two fused residual-add + RMSNorm (read x and residual, write both), RoPE on q and k
        # in place, SiLU×mul (read gate and up, write one).
        self.elementwise_act = 8 * h + 2 * (self.q_dim + self.kv_dim) + 3 * i
        self.lm_head_weights = h * model.vocab_size // tp
        self._parts: dict[tuple[int, int], _Parts] = {}  # (tokens, sequences) -> _cost's parts

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        return 2 * self.model.num_hidden_layers * self.kv_dim * self.model.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K/V bytes one token holds across all `tp` GPUs."""
        return self.kv_bytes_per_token_per_gpu * self.tp

    @property
    def weight_bytes_per_gpu(self) -> int:
        # Norm weights are replicated, not split; at 2 × hidden per layer they are negligible.
        return self.model.num_params * self.model.dtype_bytes // self.tp

    def kv_capacity_tokens(
        self, mem_util: float = 0.9, activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES
    ) -> int:
        """Tokens of K/V that fit: (memory × util − weights/tp − reserve) per GPU ÷ K/V bytes per GPU."""
        if not 0 < mem_util <= 1:
            raise ValueError(f"mem_util must be in (0, 1], got {mem_util}")
        free = self.gpu.memory_bytes * mem_util - self.weight_bytes_per_gpu - activation_reserve_bytes
        return max(0, int(free // self.kv_bytes_per_token_per_gpu))

    # ---- time ----------------------------------------------------------------------------
    def linear_work(self, num_tokens: int) -> tuple[float, float]:
        """(FLOPs, bytes) of one layer's four GEMMs on one GPU."""
        flops = 2.0 * self.linear_weights * num_tokens
        num_bytes = float(self.model.dtype_bytes * (self.linear_weights + num_tokens * self.linear_act))
        return flops, num_bytes

    def linear_layer_s(self, num_tokens: int) -> float:
        flops, num_bytes = self.linear_work(num_tokens)
        return gemm_s(self.gpu, flops, num_bytes, num_tokens, GEMMS_PER_LAYER)

    def attention_work(self, chunks: Sequence[SeqChunk]) -> tuple[float, float]:
        """(FLOPs, bytes) of one layer's attention on one GPU."""
        num_pairs, num_elems = self._attention_sums(chunks)
        return 4.0 * self.q_dim * num_pairs, float(self.model.dtype_bytes * num_elems)

    def _attention_sums(self, chunks: Sequence[SeqChunk]) -> tuple[int, int]:
        """(query-key pairs, K/V and Q elements moved) of one layer's attention on one GPU."""
        num_pairs = 0
        num_elems = 0
        for c in chunks:
            n, ctx = c.num_tokens, c.num_context_tokens
            num_pairs += n * ctx + n * (n + 1) // 2  # causal: query j sees ctx + j + 1 keys
            num_elems += 2 * n * self.q_dim + 2 * (ctx + n) * self.kv_dim + 2 * n * self.kv_dim
        return num_pairs, num_elems

    def all_reduce_s(self, num_bytes: float) -> float:
        if self.tp == 1:
            return 0.0
        eff = self.gpu.efficiency
        ring_bytes = 2 * (self.tp - 1) / self.tp * num_bytes
        return eff.allreduce_latency_s + ring_bytes / (self.gpu.nvlink_one_way_bytes_per_s * eff.link_eff)

    def step_cost(
        self, chunks: Sequence[SeqChunk], num_decodes: int = 0, num_decode_context_tokens: int = 0
    ) -> StepCost:
        """Predicted duration of one step over `chunks` and `num_decodes` more one-token
        chunks over `num_decode_context_tokens` cached tokens in all (the same figures as
        those chunks listed one by one); all zeros when there is nothing to run."""
        chunks = [c for c in chunks if c.num_tokens > 0]
        if not chunks and num_decodes < 1:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        num_tokens = sum(c.num_tokens for c in chunks) + num_decodes
        # attention_work's sums over the chunks, with n = 1 for each decode (integers, so
        # the order of the terms cannot change them).
        num_pairs, num_elems = self._attention_sums(chunks)
        num_pairs += num_decode_context_tokens + num_decodes
        num_elems += (
            num_decodes * (2 * self.q_dim + 4 * self.kv_dim) + 2 * self.kv_dim * num_decode_context_tokens
        )
        attn_flops, attn_bytes = 4.0 * self.q_dim * num_pairs, float(self.model.dtype_bytes * num_elems)
        return self._cost(num_tokens, len(chunks) + num_decodes, attn_flops, attn_bytes)

    def decode_step_cost(self, num_seqs: int, num_context_tokens: int) -> StepCost:
        """`step_cost` of `num_seqs` one-token decodes over `num_context_tokens` cached
        tokens in all: the same figures, from sums instead of a list of chunks."""
        return self.step_cost((), num_seqs, num_context_tokens)

    def _cost(self, num_tokens: int, num_seqs: int, attn_flops: float, attn_bytes: float) -> StepCost:
        gpu, eff = self.gpu, self.gpu.efficiency
        peak, hbm = gpu.peak_flops, gpu.hbm_bytes_per_s
        key = (num_tokens, num_seqs)
        parts = self._parts.get(key)
        if parts is None:
            if len(self._parts) >= PARTS_MEMO_SIZE:
                self._parts.clear()
            parts = self._parts[key] = self._parts_without_attention(num_tokens, num_seqs)
        attn_s = max(attn_flops / (peak * eff.attention_eff), attn_bytes / (hbm * eff.mem_eff))
        layers = self.model.num_hidden_layers
        return StepCost(
            linear_s=parts.linear_s,
            attention_s=layers * attn_s,
            elementwise_s=parts.elementwise_s,
            lm_head_s=parts.lm_head_s,
            allreduce_s=parts.allreduce_s,
            overhead_s=eff.step_overhead_s,
            # The same sum, in the same order, as over the parts' terms written out.
            roofline_s=(
                layers * (parts.linear_roofline_s + max(attn_flops / peak, attn_bytes / hbm))
                + parts.elementwise_roofline_s
                + parts.lm_head_roofline_s
                + parts.comm_roofline_s
            ),
        )

    def _parts_without_attention(self, num_tokens: int, num_seqs: int) -> _Parts:
        """Everything in a step's cost but its attention: a function of the step's tokens
        and sequences only, so worked out once for each pair (`_cost` remembers them)."""
        gpu, eff, m = self.gpu, self.gpu.efficiency, self.model
        layers, dt, h = m.num_hidden_layers, m.dtype_bytes, m.hidden_size
        peak, hbm = gpu.peak_flops, gpu.hbm_bytes_per_s

        lin_flops, lin_bytes = self.linear_work(num_tokens)
        elem_bytes = dt * num_tokens * self.elementwise_act
        # The embedding gather happens once per step; count it with the element-wise traffic.
        elementwise_s = (layers * elem_bytes + dt * num_tokens * h) / (hbm * eff.mem_eff)

        head_flops = 2.0 * self.lm_head_weights * num_seqs
        head_bytes = (
            dt * (self.lm_head_weights + num_seqs * h) + LOGIT_BYTES * num_seqs * m.vocab_size / self.tp
        )
        lm_head_s = gemm_s(gpu, head_flops, head_bytes, num_seqs, 1)

        hidden_bytes = float(dt * num_tokens * h)
        logits_bytes = LOGIT_BYTES * num_seqs * m.vocab_size / self.tp  # one GPU's vocabulary shard
        allreduce_s = 2 * layers * self.all_reduce_s(hidden_bytes)
        # Bytes each GPU sends: the ring all-reduces, then one gather of the logit shards.
        comm_bytes = 2 * layers * 2 * (self.tp - 1) / self.tp * hidden_bytes + (self.tp - 1) * logits_bytes
        if self.tp > 1:
            link = gpu.nvlink_one_way_bytes_per_s * eff.link_eff
            allreduce_s += eff.allreduce_latency_s + (self.tp - 1) * logits_bytes / link
        return _Parts(
            linear_s=layers * self.linear_layer_s(num_tokens),
            elementwise_s=elementwise_s,
            lm_head_s=lm_head_s,
            allreduce_s=allreduce_s,
            linear_roofline_s=max(lin_flops / peak, lin_bytes / hbm),
            elementwise_roofline_s=(layers * elem_bytes + dt * num_tokens * h) / hbm,
            lm_head_roofline_s=max(head_flops / peak, head_bytes / hbm),
            comm_roofline_s=comm_bytes / gpu.nvlink_one_way_bytes_per_s,
        )

    def step_s(self, chunks: Sequence[SeqChunk]) -> float:
        return self.step_cost(chunks).total_s

    def roofline_s(self, chunks: Sequence[SeqChunk]) -> float:
        return self.step_cost(chunks).roofline_s

    def prefill_s(self, num_tokens: int, num_context_tokens: int = 0) -> float:
        """One step that prefills `num_tokens` of a single sequence after `num_context_tokens` cached."""
        return self.step_s([SeqChunk(num_tokens, num_context_tokens)])

    def decode_step_s(self, batch: int, context: int) -> float:
        """One step that decodes one token for each of `batch` sequences holding `context` tokens."""
        return self.step_s([SeqChunk(1, context)] * batch)

    def swap_s(self, num_blocks: int, block_size: int = 16) -> float:
        """Copy `num_blocks` blocks one way over the host link; each GPU moves its own shard in parallel."""
        return num_blocks * block_size * self.kv_bytes_per_token_per_gpu / self.gpu.host_link_bytes_per_s
