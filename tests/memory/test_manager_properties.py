"""Property-based tests of the KV-cache manager under random operation sequences."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.conftest import make_request
from tierserve.config import DEFAULT_TIERS
from tierserve.memory.manager import Alloc, KVCacheManager
from tierserve.memory.partition import TierPartition
from tierserve.request import Request
from tierserve.tiers import ALL_TIERS, Tier

BLOCK = 4
NUM_BLOCKS = 40
# A few shared prefixes so the prefix cache really gets hits.
PREFIXES = [[p * 1000 + i for i in range(12)] for p in range(3)]


class MemoryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        partition = TierPartition.from_tiers(NUM_BLOCKS, DEFAULT_TIERS)
        self.mem = KVCacheManager(NUM_BLOCKS, BLOCK, num_host_blocks=24, partition=partition)
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.counter = 0

    def _new(self, tier: Tier, prefix: int, extra: int) -> Request:
        self.counter += 1
        tokens = PREFIXES[prefix] + [self.counter * 100 + i for i in range(extra)]
        return make_request(tokens=tokens, tier=tier, max_tokens=64)

    def _assert_floors(self, tier: Tier) -> None:
        # Whatever `tier` just took, the unfilled floors of more urgent tiers stay free.
        mem = self.mem
        assert mem.num_free_blocks >= mem.partition.protected_free(tier, mem.pool.used_by_tier)

    @rule(tier=st.sampled_from(ALL_TIERS), prefix=st.integers(0, 2), extra=st.integers(1, 20))
    def admit(self, tier: Tier, prefix: int, extra: int) -> None:
        req = self._new(tier, prefix, extra)
        free_before = self.mem.num_free_blocks
        status = self.mem.admit(req)
        if status is Alloc.OK:
            assert len(req.block_ids) == self.mem.blocks_for(req.num_tokens)
            assert req.num_computed_tokens % BLOCK == 0 and req.num_computed_tokens < req.num_tokens
            self.running.append(req)
            self._assert_floors(tier)
        else:
            assert not req.block_ids and self.mem.num_free_blocks == free_before

    @precondition(lambda self: self.running)
    @rule(data=st.data(), num_tokens=st.integers(1, 9))
    def compute_and_grow(self, data: st.DataObject, num_tokens: int) -> None:
        req = data.draw(st.sampled_from(self.running))
        # The request computes what it has, samples, and then asks for room for more.
        req.num_computed_tokens = req.num_tokens
        self.mem.cache_computed_blocks(req)
        req.token_ids.extend(range(7, 7 + num_tokens))
        before = list(req.block_ids)
        status = self.mem.grow(req, req.num_tokens)
        if status is Alloc.OK:
            assert len(req.block_ids) == self.mem.blocks_for(req.num_tokens)
            self._assert_floors(req.tier)
        else:
            assert req.block_ids == before
            del req.token_ids[-num_tokens:]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.running))
        self.running.remove(req)
        self.mem.free(req)
        assert not req.block_ids

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.running))
        num_blocks = len(req.block_ids)
        mapping = self.mem.swap_out(req)
        if mapping is None:
            assert self.mem.host.num_free < num_blocks
            return
        assert len(mapping) == num_blocks and len({h for _, h in mapping}) == num_blocks
        self.running.remove(req)
        self.swapped.append(req)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.swapped))
        num_blocks = len(req.host_block_ids)
        result = self.mem.swap_in(req)
        if isinstance(result, Alloc):
            assert len(req.host_block_ids) == num_blocks
            return
        assert [d for _, d in result] == req.block_ids
        self.mem.host.copies_done()  # the engine's step copies the blocks in, then frees the slots
        self.swapped.remove(req)
        self.running.append(req)
        self._assert_floors(req.tier)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def drop_swapped(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.swapped))
        self.swapped.remove(req)
        self.mem.free(req)

    @rule(tier=st.sampled_from(ALL_TIERS))
    def borrowed_blocks_are_reclaimable(self, tier: Tier) -> None:
        """A tier inside its floor + reserve that finds no space gets it once the borrowers
        less urgent than it give their blocks back."""
        mem = self.mem
        used = list(mem.pool.used_by_tier)
        borrowed = mem.partition.borrowed(used)
        if any(borrowed[u] for u in range(tier + 1)):
            return  # nobody to reclaim from: the tier itself (or a more urgent one) borrows
        if not mem.within_entitlement(tier, 1) or mem.check(tier, 1) is not Alloc.NO_SPACE:
            return
        free = mem.num_free_blocks
        for u in ALL_TIERS:
            if borrowed[u]:
                free += used[u]
                used[u] = 0
        assert free - 1 >= mem.partition.protected_free(tier, used)

    @invariant()
    def integrity(self) -> None:
        self.mem.check_integrity()
        used = self.mem.pool.used_by_tier
        for t in ALL_TIERS:
            assert used[t] <= self.mem.partition.ceiling[t]

    def teardown(self) -> None:
        for req in self.running + self.swapped:
            self.mem.free(req)
        self.mem.check_integrity()
        assert self.mem.num_free_blocks == NUM_BLOCKS, "blocks leaked"
        assert self.mem.host.num_free == self.mem.host.num_blocks, "host blocks leaked"


MemoryMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestMemoryManager = MemoryMachine.TestCase
