"""A paged KV cache as the scheduler sees it: a pool of fixed-size blocks.

Only counts are kept (which physical block holds what does not change any
timing). ``allocated_total`` and ``freed_total`` make the accounting auditable:
at any moment ``allocated_total - freed_total`` equals the blocks held by
running sequences, and at the end of a drained run it is zero.
"""
from __future__ import annotations


class KVCache:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks = num_blocks
        self.allocated_total = 0
        self.freed_total = 0

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens (ceiling division)."""
        return -(-tokens // self.block_size)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    def allocate(self, blocks: int) -> None:
        if blocks > self.free_blocks:
            raise RuntimeError(f"KV cache over-allocated: {blocks} blocks asked, {self.free_blocks} free")
        self.free_blocks -= blocks
        self.allocated_total += blocks

    def free(self, blocks: int) -> None:
        self.free_blocks += blocks
        self.freed_total += blocks
        if self.free_blocks > self.num_blocks:
            raise RuntimeError("KV cache freed more blocks than it holds")
