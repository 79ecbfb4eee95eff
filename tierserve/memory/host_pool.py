"""Host (CPU) swap space: a fixed number of block-sized slots."""

from __future__ import annotations

from tierserve.memory.errors import KVIntegrityError


class HostPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        # Slots a swap-in reads this step: free once the step's copies are done, not before
        # (a swap-out in the same pass took them and its copy, made first, overwrote them).
        self._after_copies: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)

    def free_after_copies(self, block_ids: list[int]) -> None:
        """Free `block_ids` at the next `copies_done`: a swap-in is still to read them."""
        self._after_copies.extend(block_ids)

    def copies_done(self) -> None:
        """The step's swap copies are done: the slots swap-ins read are free."""
        if self._after_copies:
            self._free.extend(self._after_copies)
            self._after_copies.clear()

    def check_integrity(self, held: list[int]) -> None:
        every = self._free + self._after_copies + held
        if not len(every) == len(set(every)) == self.num_blocks:
            raise KVIntegrityError("host swap blocks leaked or doubled")
