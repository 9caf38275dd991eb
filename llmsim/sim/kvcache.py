"""A paged KV cache as the scheduler sees it: a pool of fixed-size blocks.

Only counts are kept (which physical block holds what does not change any
timing). ``allocated_total`` and ``freed_total`` make the accounting auditable:
at any moment ``allocated_total - freed_total`` equals the blocks held by
running sequences, and at the end of a drained run it is zero.

This is the cache without prefix caching, host tier or swapping (the default):
:class:`llmsim.sim.prefix_cache.TieredKV` extends it with them, behind the same
:meth:`release` and :meth:`preempt` and the ``tiered`` flag the engine checks.
"""
from __future__ import annotations


class KVCache:
    tiered = False               # no prefix cache, host tier or swap: the engine skips their hooks
    __slots__ = ("num_blocks", "block_size", "free_blocks", "allocated_total", "freed_total")

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

    @property
    def held_blocks(self) -> int:
        """Blocks allocated and not freed (``allocated_total - freed_total``)."""
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

    def release(self, request, now: float, kv_tokens: int) -> None:
        """``request`` leaves (finished) holding ``kv_tokens`` tokens of KV: its blocks are free."""
        self.free(request.blocks)

    def preempt(self, request, now: float, kv_tokens: int) -> int:
        """``request`` is preempted: its blocks are free; returns the KV tokens it keeps (none: recompute)."""
        self.free(request.blocks)
        return 0
