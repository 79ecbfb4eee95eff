"""Sampling: greedy, filters, penalties, and draws that depend only on (seed, output index)."""

from __future__ import annotations

import math

import pytest
import torch

from tierserve.executors.pytorch.sampling import (
    Sampler,
    SampleRequest,
    apply_penalties,
    filter_logits,
    mix_seed,
)
from tierserve.request import SamplingParams

LOGITS = torch.tensor([0.0, 3.0, 1.0, 2.5, -1.0, 2.0])


def draws(sampler: Sampler, params: SamplingParams, n: int, rid: str = "a", start: int = 0) -> list[int]:
    rows = LOGITS.repeat(n, 1)
    return sampler.sample(rows, [SampleRequest(rid, params, start + k) for k in range(n)])


def test_greedy_takes_the_argmax_of_each_row() -> None:
    logits = torch.stack([LOGITS, -LOGITS])
    reqs = [SampleRequest("a", SamplingParams(), 0), SampleRequest("b", SamplingParams(), 0)]
    assert Sampler().sample(logits, reqs) == [1, 4]


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 1e-6])
def test_a_vanishing_temperature_is_greedy_and_spares_the_rows_beside_it(temperature: float) -> None:
    """Logits divided by less than ~1e-38 overflow float32 to inf, and the draw fails: one
    such request must not fail a step for the others in it."""
    logits = torch.stack([LOGITS, -LOGITS, LOGITS])
    reqs = [
        SampleRequest("tiny", SamplingParams(temperature=temperature), 0),
        SampleRequest("warm", SamplingParams(temperature=1.0, seed=3), 0),
        SampleRequest(
            "tiny-penalised", SamplingParams(temperature=temperature, presence_penalty=2.0), 1, [1]
        ),
    ]
    tokens = Sampler().sample(logits, reqs)
    assert tokens[0] == 1 and tokens[2] == 3  # the argmax; the penalised one moves off token 1
    assert 0 <= tokens[1] < len(LOGITS)


def test_top_k_keeps_only_the_k_largest() -> None:
    kept = filter_logits(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert [i for i in range(6) if math.isfinite(kept[i])] == [1, 3]
    assert set(draws(Sampler(), SamplingParams(temperature=5.0, top_k=2, seed=1), 60)) == {1, 3}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.softmax(LOGITS, -1)  # sorted: 1 (.43), 3 (.26), 5 (.16), 2 (.06) ...
    p = float(probs[1] + probs[3]) - 1e-3
    kept = filter_logits(LOGITS, SamplingParams(temperature=1.0, top_p=p))
    assert [i for i in range(6) if math.isfinite(kept[i])] == [1, 3]
    tiny = filter_logits(LOGITS, SamplingParams(temperature=1.0, top_p=1e-6))
    assert [i for i in range(6) if math.isfinite(tiny[i])] == [1]  # the top token always stays


def test_draws_depend_only_on_seed_and_output_index() -> None:
    params = SamplingParams(temperature=2.0, seed=42)
    first = draws(Sampler(salt=1), params, 40)
    assert draws(Sampler(salt=2), params, 40) == first  # an explicit seed ignores the salt
    assert draws(Sampler(), params, 20, start=20) == first[20:]  # resuming at index 20
    assert len(set(first)) > 2  # it really is random across indices
    assert draws(Sampler(), SamplingParams(temperature=2.0, seed=43), 40) != first


def test_unseeded_draws_follow_the_request_id_and_salt() -> None:
    params = SamplingParams(temperature=2.0)
    a = draws(Sampler(salt=9), params, 40, rid="x")
    assert draws(Sampler(salt=9), params, 40, rid="x") == a
    assert draws(Sampler(salt=9), params, 40, rid="y") != a
    assert draws(Sampler(salt=10), params, 40, rid="x") != a


def test_mixed_seeds_are_distinct_and_in_range() -> None:
    seeds = {mix_seed(s, k) for s in range(20) for k in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)
    assert mix_seed(-5, 0) >= 0


def test_penalties_subtract_presence_once_and_frequency_per_appearance() -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(LOGITS, params, [3, 3, 5, 3])
    expected = LOGITS.clone()
    expected[3] -= 0.5 + 3 * 0.25
    expected[5] -= 0.5 + 0.25
    torch.testing.assert_close(out, expected)
    assert apply_penalties(LOGITS, params, []) is LOGITS  # nothing generated yet


def test_greedy_with_a_presence_penalty_moves_off_a_token_already_said() -> None:
    params = SamplingParams(presence_penalty=2.0)
    rows = LOGITS.repeat(2, 1)
    reqs = [SampleRequest("a", params, 0, ()), SampleRequest("b", params, 1, (1,))]
    assert Sampler().sample(rows, reqs) == [1, 3]  # 3.0 - 2.0 falls below token 3's 2.5


def test_a_seeded_draw_sees_the_penalised_logits() -> None:
    # Token 1 is likeliest; a large presence penalty on it makes it the least likely.
    params = SamplingParams(temperature=0.3, seed=5, presence_penalty=2.0)
    sampler = Sampler()
    free = [sampler.sample(LOGITS[None], [SampleRequest("a", params, k, ())])[0] for k in range(40)]
    penalised = [sampler.sample(LOGITS[None], [SampleRequest("a", params, k, (1, 1))])[0] for k in range(40)]
    assert free.count(1) > 20 and penalised.count(1) < free.count(1)


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_penalties_are_bounded_like_openais(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: 2.5})  # type: ignore[arg-type]


def test_a_repetition_penalty_divides_positive_logits_and_multiplies_negative_ones() -> None:
    """transformers' and vLLM's, over the prompt's tokens and the output's, each once."""
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), [3, 3], (1, 3))
    torch.testing.assert_close(out, torch.tensor([2.0, -2.0, 0.5, 1.5, -2.0]))


def test_a_prompt_kept_as_a_tensor_is_used_only_for_the_same_prompt() -> None:
    """The sampler keeps each request's prompt as a tensor (rebuilt at every step, a 32k-token
    prompt cost 2 ms); a request id seen again with another prompt (a bench's "r0" in a second
    run on the same executor) must not be penalised by the first one's tokens."""
    params = SamplingParams(repetition_penalty=10.0)
    rows = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    sampler = Sampler()
    assert sampler.sample(rows, [SampleRequest("r0", params, 0, (), (0,))]) == [1]  # 0 penalised
    assert sampler.sample(rows, [SampleRequest("r0", params, 0, (), (1,))]) == [0]  # 1 is, now
    assert sampler.sample(rows, [SampleRequest("r0", params, 0, (), [0])]) == [1]
