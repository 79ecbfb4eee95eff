"""Host (CPU) swap space: a fixed number of block-sized slots."""

from __future__ import annotations

from tierserve.memory.errors import KVIntegrityError


class HostPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)

    def check_integrity(self, held: list[int]) -> None:
        every = self._free + held
        if not len(every) == len(set(every)) == self.num_blocks:
            raise KVIntegrityError("host swap blocks leaked or doubled")
