"""The KV-cache memory hierarchy of one replica: prefix caching, a host-memory tier, swapping.

:class:`TieredKV` is a :class:`~llmsim.sim.kvcache.KVCache` (the engine allocates and frees
blocks from it the same way) with three optional mechanisms, each off by default:

* **Prefix caching**, as vLLM's automatic prefix caching: a full block whose content is known
  (its *key*, see :class:`PrefixKeys`) is entered in the cache when it is filled. Keys are
  chained: a key stands for its block *and everything before it*, so a request reuses the
  longest run of leading blocks found in the cache (partial blocks are never shared, and at
  least the prompt's last token is computed). Shared blocks carry reference counts; a block
  nobody references stays cached, *idle*, until it is evicted, least recently released first
  (a request's blocks are released last block first, so its tail goes before its head, as in
  vLLM). Idle blocks count as free: allocating evicts them when no empty block is left.
  A request's cached tokens are not computed again: its prefill starts after them, and the
  cost model prices the rest with attention over the whole context.
* **A host-memory tier**: an idle block that stays idle ``idle_timeout_s`` moves to host
  memory (the GPU block is freed); host memory is an LRU of its own: to make room it evicts its
  least recently used cached blocks (counted), and when even that cannot make room (the tier
  is full of pinned swapped KV) the offload fails and the block is dropped (counted too). A
  request whose leading blocks are in host memory reloads them over the host link instead of
  computing them again.
* **Swap preemption** (vLLM's ``preemption_mode: swap``): a preempted request's KV is copied
  to host memory and copied back when it is admitted again, instead of being recomputed.
  Swapped KV is pinned in host memory (the LRU never drops it); when host memory cannot hold
  it, the request is recomputed (counted). Its full blocks also stay in the GPU prefix cache
  (idle, evictable) like any released request's: at swap-in the leading ones still there are
  shared, and only the rest is copied back.

**Copies and time.** Each block copy takes ``block_transfer_s`` on its direction of the host
link (full duplex: device-to-host and host-to-device run independently). Host-to-device copies
(reloads, swap-ins) are started by the iteration that admits the request, which needs them.
Device-to-host copies (offloads, swap-outs) queue on their direction: a swap-out starts when
it is decided, an offload when its block becomes due, but not while an iteration runs unless
copies overlap compute (synchronous copies run between iterations). With ``overlap`` false an
iteration first waits for the device-to-host queue and its host-to-device copies, then
computes (their sum); with ``overlap`` true it takes the longest of the three. An offload that
becomes due and finishes while the engine is idle costs no iteration time.

Accounting is exact per tier: ``allocated_total - freed_total`` is what the tier holds.
On the GPU that is the blocks requests hold privately plus the cached blocks (referenced
or idle); on the host, the cached blocks plus the swapped ones.
"""
from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from llmsim.sim.kvcache import KVCache

_SPAN = 1 << 32                 # keys of one owner: owner * _SPAN + block index


class PrefixKeys:
    """The content keys of each request's full KV blocks, at one block size.

    A trace says what requests share in one of two ways. Sessions (``session_id``, with an
    optional shared system prompt ``system_prompt_id`` of ``system_prompt_tokens`` tokens):
    each session is one token stream (system prompt, then every turn's new input and output),
    and each turn's prompt is a prefix of it, so block ``j`` of a turn is block ``j`` of its
    session's stream: its key names (session, j), or (system prompt, j) when the block lies
    wholly in the shared system prompt. A request outside any session is a session of its own.
    The stream continues with the request's output, so the blocks its output fills are keyed too
    (the next turn reuses them). Hashes (``hash_ids``, one per ``hash_block_tokens`` tokens of the
    prompt, each standing for its block and everything before it, as in Mooncake traces): engine
    block ``j`` gets the hash of the hash block holding its last token and its place in that hash
    block; only prompt blocks are keyed. ``block_size`` must divide ``hash_block_tokens``.
    """

    def __init__(self, block_size: int, prompt_tokens: np.ndarray, output_tokens: np.ndarray,
                 session_id: np.ndarray | None = None, system_prompt_id: np.ndarray | None = None,
                 system_prompt_tokens: np.ndarray | None = None, hash_ids=None, hash_block_tokens: int | None = None):
        self.block_size = block_size
        self._prompt, self._output = prompt_tokens, output_tokens
        self._hash_ids = hash_ids
        if hash_ids is not None:
            if hash_block_tokens is None:
                raise ValueError("a trace's hash ids need its hash block size")
            if hash_block_tokens % block_size:
                raise ValueError(f"block size {block_size} does not divide the trace's hash block "
                                 f"of {hash_block_tokens} tokens")
            self._per_hash = hash_block_tokens // block_size
            return
        n = len(prompt_tokens)
        sessions = np.full(n, -1, np.int64) if session_id is None else np.asarray(session_id, np.int64)
        # Requests outside a session own the ids after every session's.
        first_free = int(sessions.max()) + 1 if n else 0
        self._owner = np.where(sessions >= 0, sessions, first_free + np.arange(n)).tolist()
        if system_prompt_id is None:
            self._template, self._system_blocks = [-1] * n, [0] * n
        else:
            self._template = np.asarray(system_prompt_id, np.int64).tolist()
            self._system_blocks = (np.asarray(system_prompt_tokens, np.int64) // block_size).tolist()

    def of(self, i: int) -> list[int]:
        """Keys of request ``i``'s full blocks, first to last."""
        size = self.block_size
        if self._hash_ids is not None:
            hashes, per = self._hash_ids[i], self._per_hash
            return [hashes[j // per] * per + j % per for j in range(int(self._prompt[i]) // size)]
        blocks = (int(self._prompt[i]) + int(self._output[i])) // size
        template = self._template[i]
        shared = min(self._system_blocks[i], blocks) if template >= 0 else 0
        own = self._owner[i] * _SPAN
        keys = list(range(-template * _SPAN - 1, -template * _SPAN - 1 - shared, -1)) if shared else []
        keys.extend(range(own + shared, own + blocks))
        return keys


class HostTier:
    """Host memory for KV blocks of one replica: an LRU of cached blocks plus pinned swapped ones.

    ``occupancy_s`` / ``occupancy_blocks`` log the blocks held after every change.
    """

    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.swapped = 0
        self.allocated_total = 0
        self.freed_total = 0
        self.evicted = 0               # cached blocks dropped, least recently used first, to make room
        self.failed = 0                # blocks that could not enter at all (the tier is full of swapped KV)
        self.occupancy_s, self.occupancy_blocks = array("d", [0.0]), array("q", [0])

    @property
    def held(self) -> int:
        return len(self.lru) + self.swapped

    def _log(self, now: float) -> None:
        self.occupancy_s.append(now)
        self.occupancy_blocks.append(len(self.lru) + self.swapped)

    def make_room(self, blocks: int) -> bool:
        """Drop least recently used cached blocks until ``blocks`` fit; False if they cannot."""
        if blocks > self.capacity_blocks - self.swapped:
            return False
        lru = self.lru
        while len(lru) + self.swapped + blocks > self.capacity_blocks:
            lru.popitem(last=False)
            self.freed_total += 1
            self.evicted += 1
        return True

    def add(self, keys: Sequence[int], now: float) -> int:
        """Cache ``keys`` in turn; returns how many had to be copied in. One already there becomes the most
        recent (no copy); one with no room even after evicting every cached block is counted in ``failed``
        (dropped). Each copy is logged (:meth:`_log`)."""
        lru, swapped, capacity = self.lru, self.swapped, self.capacity_blocks
        log_s, log_blocks = self.occupancy_s.append, self.occupancy_blocks.append
        copied = 0
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
                continue
            if len(lru) + swapped >= capacity and not self.make_room(1):    # (not full: nothing to evict)
                self.failed += 1
                continue
            lru[key] = None
            copied += 1
            log_s(now)
            log_blocks(len(lru) + swapped)
        self.allocated_total += copied
        return copied

    def swap_out(self, blocks: int, now: float) -> bool:
        if not self.make_room(blocks):
            return False
        self.swapped += blocks
        self.allocated_total += blocks
        self._log(now)
        return True

    def swap_in(self, blocks: int, now: float) -> None:
        self.swapped -= blocks
        self.freed_total += blocks
        self._log(now)


class TieredKV(KVCache):
    """One replica's KV blocks with prefix caching, a host tier and swapping (see the module docstring).

    ``free_blocks`` counts what an allocation can take: empty blocks plus idle cached ones
    (``empty_blocks`` alone are empty). ``keys`` is None without prefix caching; ``host`` None
    without a host tier. ``block_transfer_s`` is the time to move one block over the host
    link in one direction (each device moves its shard over its own link), ``block_bytes`` a
    block's bytes over all the replica's devices.
    """

    tiered = True

    def __init__(self, num_blocks: int, block_size: int, keys: PrefixKeys | None = None,
                 host: HostTier | None = None, idle_timeout_s: float | None = None, swap: bool = False,
                 overlap: bool = False, block_transfer_s: float = 0.0, block_bytes: float = 0.0):
        super().__init__(num_blocks, block_size)
        self.empty_blocks = num_blocks
        self.keys, self.host = keys, host
        self.idle_timeout_s = idle_timeout_s if host is not None else None
        self.swap, self.overlap = swap and host is not None, overlap
        self.block_transfer_s, self.block_bytes = block_transfer_s, block_bytes
        self.cached: dict[int, int] = {}                      # key -> references, GPU-resident blocks
        self.idle: OrderedDict[int, float] = OrderedDict()   # unreferenced cached blocks -> released at
        self.offload_due_s = math.inf                         # no idle block is due before this (:meth:`advance`)
        self._hits = 0                                        # the last match: leading hits, keys to reload
        self._reload: Sequence[int] = ()
        self._h2d_s = 0.0                                     # host-to-device copies the next iteration waits for
        self._d2h_free_s = 0.0                                # when device-to-host copies queued so far end
        self._busy_until_s = 0.0                              # when the last priced iteration ends
        # Totals over the run: blocks; seconds of link time (both directions) and of iteration time
        # the copies added (``stall_s``).
        self.lookups = self.hit_blocks = self.reloaded_blocks = 0
        self.offloaded_blocks = self.evicted_blocks = 0
        self.swapped_out_blocks = self.swapped_in_blocks = 0
        self.swap_resident_blocks = 0                         # swapped-out blocks still on the GPU at swap-in
        self.swap_failed_preemptions = 0                      # swaps host memory could not hold: recomputed
        self.transfer_s = self.offload_s = self.stall_s = 0.0

    # -- the block pool ---------------------------------------------------------------------------
    def allocate(self, blocks: int) -> None:
        if blocks > self.free_blocks:
            raise RuntimeError(f"KV cache over-allocated: {blocks} blocks asked, {self.free_blocks} free")
        short = blocks - self.empty_blocks
        if short > 0:                                         # evict idle cached blocks, oldest first
            idle, cached = self.idle, self.cached
            for _ in range(short):
                del cached[idle.popitem(last=False)[0]]
            self.empty_blocks += short
            self.freed_total += short
            self.evicted_blocks += short
        self.empty_blocks -= blocks
        self.free_blocks -= blocks
        self.allocated_total += blocks

    def free(self, blocks: int) -> None:
        self.empty_blocks += blocks
        self.free_blocks += blocks
        self.freed_total += blocks
        if self.empty_blocks > self.num_blocks:
            raise RuntimeError("KV cache freed more blocks than it holds")

    @property
    def held_blocks(self) -> int:
        """Blocks not empty: held by requests or cached."""
        return self.num_blocks - self.empty_blocks

    # -- time passes --------------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        """Move blocks idle for ``idle_timeout_s`` by ``now`` to host memory (at the time they became due).

        Idle blocks are kept in the order they were released, so the oldest comes first, and the blocks
        released together (one :meth:`release`, or several at one time) follow one another and become due
        together: they enter host memory as one group. ``offload_due_s`` is never later than when the oldest
        idle block becomes due (:meth:`release` lowers it to its blocks' due time, which only the first idle
        block's is below, since an engine releases in time order and the engines sharing a cache, a
        pipeline's micro-batches, take turns in time order; blocks that leave the idle list only make the
        next one due later): before it nothing is due, and nothing is looked at (the engine calls this every
        iteration)."""
        if now < self.offload_due_s:
            return
        timeout, idle, cached = self.idle_timeout_s, self.idle, self.cached
        assert self.host is not None and timeout is not None  # offload_due_s is finite only with a host tier
        groups: list[tuple[float, list[int]]] = []            # (due at, keys), oldest first
        keys: list[int] = []
        released_at_s = math.inf
        for key, released_s in idle.items():
            if released_s != released_at_s:
                due_s = released_s + timeout
                if due_s > now:
                    self.offload_due_s = due_s
                    break
                released_at_s, keys = released_s, []
                groups.append((due_s, keys))
            keys.append(key)
        else:
            self.offload_due_s = math.inf
        host, copy_s = self.host, self.block_transfer_s
        between_s = 0.0 if self.overlap else self._busy_until_s   # synchronous copies wait for the iteration
        d2h_free_s, offload_s, transfer_s = self._d2h_free_s, self.offload_s, self.transfer_s
        for due_s, keys in groups:
            for key in keys:
                del idle[key]
                del cached[key]
            self.empty_blocks += len(keys)                    # free_blocks already counted them
            self.freed_total += len(keys)
            copied = host.add(keys, due_s)
            self.offloaded_blocks += copied
            for _ in range(copied):                           # each queues on the device-to-host direction
                d2h_free_s = max(due_s, d2h_free_s, between_s) + copy_s
                offload_s += copy_s
                transfer_s += copy_s
        self._d2h_free_s, self.offload_s, self.transfer_s = d2h_free_s, offload_s, transfer_s

    def clear(self, now: float) -> None:
        """The replica is switched off (it holds no request): its cached blocks, on the GPU and in host
        memory, are gone."""
        cached = len(self.cached)
        if self.num_blocks - self.empty_blocks != cached or len(self.idle) != cached:
            raise RuntimeError("KV cache cleared while requests hold blocks")
        self.cached.clear()
        self.idle.clear()
        self.empty_blocks += cached                           # free_blocks already counted them
        self.freed_total += cached
        host = self.host
        if host is not None:
            host.freed_total += len(host.lru)
            host.lru.clear()
            host._log(now)

    # -- admission ----------------------------------------------------------------------------------
    def match(self, request, now: float) -> None:
        """Find what ``request`` (at the queue head) need not compute: set ``request.prefilled`` to the
        tokens of its leading blocks cached on the GPU or in host memory, or of its swapped-out KV."""
        if request.swapped_tokens:
            request.prefilled = request.swapped_tokens
            self._hits, self._reload = self.resident_prefix(request, request.swapped_tokens), ()
            return
        self._hits, self._reload = self.cached_prefix(request, request.prefill_target)
        request.prefilled = self._hits * self.block_size

    def keys_of(self, request) -> list[int]:
        """``request``'s block keys (empty without prefix caching), computed once."""
        keys = request.prefix_keys
        if keys is None:
            keys = request.prefix_keys = self.keys.of(request.id) if self.keys is not None else ()
        return keys

    def cached_prefix(self, request, tokens: int) -> tuple[int, list[int]]:
        """How many leading blocks of the first ``tokens`` tokens of ``request`` are cached, on the GPU
        or in host memory (never all of them: the last token is computed), and the keys of those in
        host memory only."""
        keys = self.keys_of(request)
        usable = min((tokens - 1) // self.block_size, len(keys))
        cached, host = self.cached, self.host
        lru = host.lru if host is not None else ()
        reload: list[int] = []
        for hits, key in enumerate(keys[:usable]):
            if key not in cached:
                if key not in lru:
                    return hits, reload
                reload.append(key)
        return usable, reload

    def resident_prefix(self, request, tokens: int) -> int:
        """How many leading full blocks of the first ``tokens`` tokens of ``request`` are on the GPU."""
        keys = self.keys_of(request)
        usable = min(tokens // self.block_size, len(keys))
        cached = self.cached
        hits = 0
        while hits < usable and keys[hits] in cached:
            hits += 1
        return hits

    def admit(self, request, chunk: int, now: float) -> bool:
        """Take the blocks the last :meth:`match` found plus room for ``chunk`` more tokens, or
        return False (nothing taken) if they do not fit."""
        size = self.block_size
        hits, reload = self._hits, self._reload
        shared = request.prefix_keys[:hits]
        cached = self.cached
        wanted = -(-(request.prefilled + chunk) // size) - hits + len(reload)
        if wanted + hits > self.free_blocks:                  # (else they fit, however many of the hits are idle)
            reviving = sum(1 for key in shared if cached.get(key) == 0)
            if wanted + reviving > self.free_blocks:
                return False
        idle = self.idle
        revived = 0
        for key in shared:
            references = cached.get(key)
            if references is None:                            # to be reloaded
                continue
            if references == 0:
                del idle[key]
                revived += 1
            cached[key] = references + 1
        self.free_blocks -= revived
        self.allocate(wanted)
        if reload:
            assert self.host is not None                      # blocks reload only from a host tier
            lru = self.host.lru
            for key in reload:
                cached[key] = 1
                lru.move_to_end(key)
            self.reloaded_blocks += len(reload)
            self._copy_in(len(reload))
        if request.swapped_tokens:                            # its swapped KV, less what is still resident
            back = -(-request.swapped_tokens // size)
            assert self.host is not None                      # swapping needs a host tier
            self.host.swap_in(back, now)
            self.swapped_in_blocks += back - hits
            self.swap_resident_blocks += hits
            self._copy_in(back - hits)
            request.swapped_tokens = 0
        request.blocks = hits + wanted - len(reload)
        request.cached_blocks = hits
        if request.first_scheduled_s != request.first_scheduled_s:     # first admission: its hit counts
            self.lookups += 1
            self.hit_blocks += hits
            request.cached_tokens = hits * size
            request.reloaded_tokens = len(reload) * size
        return True

    def _copy_in(self, blocks: int) -> None:
        """``blocks`` host-to-device copies for the next iteration."""
        copy_s = blocks * self.block_transfer_s
        self._h2d_s += copy_s
        self.transfer_s += copy_s

    def charge(self, now: float, duration_s: float) -> float:
        """The duration of the iteration starting ``now`` that computes for ``duration_s``, with the
        copies it waits for: its host-to-device copies and the device-to-host queue (see the module
        docstring)."""
        in_s, out_s = self._h2d_s, self._d2h_free_s - now
        if in_s or out_s > 0:
            self._h2d_s = 0.0
            out_s = max(out_s, 0.0)
            charged_s = max(duration_s, in_s, out_s) if self.overlap else duration_s + in_s + out_s
            self.stall_s += charged_s - duration_s
            duration_s = charged_s
        self._busy_until_s = now + duration_s
        return duration_s

    # -- filling and leaving ------------------------------------------------------------------------
    def filled(self, request) -> None:
        """``request`` computed a prompt chunk: its newly full blocks enter the prefix cache."""
        keys = request.prefix_keys
        full = min(request.prefilled // self.block_size, len(keys))
        if full > request.cached_blocks:
            self._enter(keys, request.cached_blocks, full)
            request.cached_blocks = full

    def _enter(self, keys, first: int, stop: int) -> None:
        """A request's private blocks ``first..stop-1`` become cached blocks it references."""
        cached, idle = self.cached, self.idle
        for key in keys[first:stop]:
            references = cached.get(key)
            if references is None:
                cached[key] = 1
                continue
            # The same content was cached meanwhile (another request computed it): share that
            # block and give back the private copy.
            if references == 0:
                del idle[key]
                self.free_blocks -= 1
            cached[key] = references + 1
            self.free(1)

    def release(self, request, now: float, kv_tokens: int) -> None:
        """``request`` leaves holding ``kv_tokens`` of KV: its full keyed blocks stay cached (idle
        once no one references them), the rest are freed."""
        keys = request.prefix_keys or ()
        full = min(kv_tokens // self.block_size, len(keys))
        shared = request.cached_blocks
        if full > shared:
            self._enter(keys, shared, full)
            shared = full
        self.free(request.blocks - shared)
        cached, idle = self.cached, self.idle
        idled = len(idle)
        for key in reversed(keys[:shared]):                  # tail first: it is evicted first
            references = cached[key] - 1
            cached[key] = references
            if references == 0:
                idle[key] = now
        idled = len(idle) - idled
        if idled:
            self.free_blocks += idled
            timeout = self.idle_timeout_s
            if timeout is not None and now + timeout < self.offload_due_s:     # (only the first idle block's,
                self.offload_due_s = now + timeout                            # as releases come in time order)
        request.blocks = request.cached_blocks = 0

    def preempt(self, request, now: float, kv_tokens: int) -> int:
        """Swap ``request``'s KV out when swapping and host memory can hold it (it keeps its
        ``kv_tokens``), else free it for recompute (it keeps none)."""
        if self.swap and kv_tokens > 0:
            blocks = -(-kv_tokens // self.block_size)
            assert self.host is not None                      # self.swap needs a host tier
            if self.host.swap_out(blocks, now):
                self.swapped_out_blocks += blocks
                copy_s = blocks * self.block_transfer_s
                self._d2h_free_s = max(now, self._d2h_free_s) + copy_s
                self.transfer_s += copy_s
                self.release(request, now, kv_tokens)
                request.swapped_tokens = kv_tokens
                return kv_tokens
            self.swap_failed_preemptions += 1
        self.release(request, now, kv_tokens)
        return 0
