"""A model of PyTorch's CUDA caching allocator: replays allocations and frees, reports reserved memory.

CPU pilots and estimates see every tensor storage come and go (probes/memory.py), but no device has a
reserved pool there. Replaying that trace through this model gives the reserved peak a CUDA GPU would show
for the same allocations. Each rule is the one in c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch @
001074d2; the functions named below), as of the allocator torch 2.13 ships:

- round_size: every request rounds up to 512 bytes (kMinBlockSize).
- get_pool: requests of at most 1 MiB (kSmallSize) use the small pool, larger ones the large pool.
- get_allocation_size: a new segment is 2 MiB (kSmallBuffer) for the small pool, 20 MiB (kLargeBuffer) for
  requests under 10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB (kRoundLarge).
- get_free_block: best fit, the smallest cached block of the stream that holds the request (ties: lowest
  address); with max_split_size, no block of that size or more serves a smaller request, and one serves a
  larger request only within 20 MiB (kLargeBuffer) of its size.
- should_split / alloc_found_block: the rest of the block is split off when it is at least 512 bytes (small
  pool, or expandable segments), or more than 1 MiB and the request is under max_split_size (large pool).
- free_block / try_merge_blocks: a freed block merges with free neighbours of its segment.
- alloc_block: with a memory limit (set_per_process_memory_fraction), a segment that would pass it fails;
  malloc then frees cached oversize blocks (release_available_cached_blocks, only with max_split_size), then
  every cached unsplit segment (release_cached_blocks), and retries; if that fails too, it is an OOM.
- garbage_collect_cached_blocks: with a limit and garbage_collection_threshold, before a new segment, free
  unsplit cached large blocks older than the average (age = get_free_block calls since cached) until
  reserved is back under the threshold.
- expandable_segments: one growing segment per pool and stream, mapped in 2 MiB pages (small pool) or
  20 MiB pages (large pool); requests are not rounded to segment sizes, only pages are mapped; release maps
  back only whole free pages (find_expandable_block, map_block, unmap_block).
- empty_cache: release_cached_blocks.

Not modelled: several streams' event ordering (blocks are reused at once on their stream), CUDA graphs'
private pools, roundup_power2_divisions (refused when asked, rather than guessed).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

KB512 = 512
SMALL_SIZE = 1 << 20  # kSmallSize
SMALL_BUFFER = 2 << 20  # kSmallBuffer
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
LARGE_BUFFER = 20 << 20  # kLargeBuffer
ROUND_LARGE = 2 << 20  # kRoundLarge
UNLIMITED = 1 << 62


class SimulatedOOM(RuntimeError):
    pass


@dataclass(frozen=True)
class AllocatorConfig:
    """PYTORCH_CUDA_ALLOC_CONF options the model follows, plus the memory limit a fraction sets."""

    max_split_size: int = UNLIMITED
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0
    limit_bytes: int | None = None  # set_per_process_memory_fraction × device memory; None: no limit

    @classmethod
    def parse(cls, text: str | None, limit_bytes: int | None = None) -> "AllocatorConfig":
        """'max_split_size_mb:128,expandable_segments:True,garbage_collection_threshold:0.6'"""
        kw: dict = {"limit_bytes": limit_bytes}
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            key, _, value = part.partition(":")
            if key == "max_split_size_mb":
                kw["max_split_size"] = int(float(value) * (1 << 20))
            elif key == "expandable_segments":
                kw["expandable_segments"] = value.strip().lower() in ("true", "1")
            elif key == "garbage_collection_threshold":
                kw["garbage_collection_threshold"] = float(value)
            elif key in ("backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                         "pinned_num_register_threads", "max_non_split_rounding_mb"):
                continue  # no effect on the device pool's sizes in this model
            else:
                raise ValueError(f"allocator option {key!r} is not modelled")
        return cls(**kw)


class Block:
    __slots__ = ("ptr", "size", "stream", "small", "allocated", "prev", "next", "mapped", "segment", "gc_base")

    def __init__(self, ptr: int, size: int, stream: int, small: bool, segment: int, mapped: bool = True):
        self.ptr, self.size, self.stream, self.small, self.segment = ptr, size, stream, small, segment
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated, self.mapped, self.gc_base = False, mapped, 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def key(self) -> tuple:
        return self.stream, self.size, self.ptr


class Pool:
    """Free (cached) blocks ordered by (stream, size, address), as BlockComparatorSize orders them."""

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[tuple] = []
        self.blocks: dict[tuple, Block] = {}
        self.free_calls = 0  # get_free_blocks_call_count

    def insert(self, b: Block) -> None:
        b.gc_base = self.free_calls
        k = b.key()
        bisect.insort(self.keys, k)
        self.blocks[k] = b

    def remove(self, b: Block) -> None:
        k = b.key()
        if self.blocks.get(k) is b:
            del self.keys[bisect.bisect_left(self.keys, k)]
            del self.blocks[k]

    def lower_bound(self, stream: int, size: int) -> Block | None:
        i = bisect.bisect_left(self.keys, (stream, size, -1))
        if i == len(self.keys) or self.keys[i][0] != stream:
            return None
        return self.blocks[self.keys[i]]

    def __iter__(self):
        return iter([self.blocks[k] for k in self.keys])


def round_size(size: int) -> int:
    return KB512 if size < KB512 else KB512 * ((size + KB512 - 1) // KB512)


def allocation_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


class CachingAllocator:
    """Reserved and allocated bytes (current and peak) for a stream of malloc / free calls."""

    def __init__(self, config: AllocatorConfig | None = None):
        self.config = config or AllocatorConfig()
        self.pools = {True: Pool(True), False: Pool(False)}
        self.reserved = self.allocated = 0
        self.peak_reserved = self.peak_allocated = 0
        self.num_ooms = 0
        self._next_ptr = 1 << 40
        self._segment_ids = itertools.count()
        self._segments: dict[tuple[bool, int], Block] = {}  # expandable: (small, stream) -> first block
        self._expandable_ids: set[int] = set()
        self.live: dict = {}  # handle -> Block

    # --- the public calls ---

    def malloc(self, handle, nbytes: int, stream: int = 0) -> None:
        """Allocate `nbytes` for `handle` (zero bytes take no block, as in the allocator)."""
        if nbytes <= 0:
            return
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self.pools[small]
        block = self.get_free_block(pool, size, stream)
        if block is None:
            if self.config.limit_bytes is not None and self.config.garbage_collection_threshold > 0:
                self.garbage_collect()
            block = (self.alloc_block(pool, size, stream)
                     or (self.alloc_block(pool, size, stream)
                         if self.release_available_cached_blocks(pool, size, stream) else None)
                     or (self.alloc_block(pool, size, stream) if self.release_cached_blocks() else None))
        if not block:
            self.num_ooms += 1
            raise SimulatedOOM(f"simulated CUDA OOM: {size} bytes with {self.reserved} reserved "
                               f"(limit {self.config.limit_bytes})")
        block = self.alloc_found_block(pool, block, size)
        block.allocated = True
        self.live[handle] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, handle) -> None:
        block = self.live.pop(handle, None)
        if block is None:
            return
        block.allocated = False
        self.allocated -= block.size
        pool = self.pools[block.small]
        for other in (block.prev, block.next):
            self.try_merge(block, other, pool)
        pool.insert(block)

    def empty_cache(self) -> None:
        self.release_cached_blocks()

    def reset_peak(self) -> None:
        self.peak_reserved, self.peak_allocated = self.reserved, self.allocated

    # --- the allocator's own steps ---

    def get_free_block(self, pool: Pool, size: int, stream: int) -> Block | None:
        if self.config.limit_bytes is not None and self.config.garbage_collection_threshold > 0:
            pool.free_calls += 1
        i = bisect.bisect_left(pool.keys, (stream, size, -1))
        if i == len(pool.keys) or pool.keys[i][0] != stream:
            return None
        b = pool.blocks[pool.keys[i]]
        # A free block that ends where the segment is unmapped can grow: it counts as that much larger.
        grow = lambda x: x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)  # noqa: E731
        while b.segment in self._expandable_ids and i + 1 < len(pool.keys) and pool.keys[i + 1][0] == stream:
            nxt = pool.blocks[pool.keys[i + 1]]
            if grow(nxt) >= grow(b):
                break
            i, b = i + 1, nxt
        mss = self.config.max_split_size
        if size < mss and b.size >= mss:
            return None
        if size >= mss and b.size >= size + LARGE_BUFFER:
            return None
        pool.remove(b)
        return b

    def should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.config.expandable_segments:
            return remaining >= KB512
        return size < self.config.max_split_size and remaining > SMALL_SIZE

    def alloc_found_block(self, pool: Pool, block: Block, size: int) -> Block:
        if not self.should_split(block, size):
            return block
        rest = Block(block.ptr + size, block.size - size, block.stream, block.small, block.segment)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, size
        pool.insert(rest)
        return block

    def try_merge(self, dst: Block, src: Block | None, pool: Pool) -> None:
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            pool.remove(src)
        if dst.prev is src:
            dst.ptr, dst.prev = src.ptr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _fits_limit(self, nbytes: int) -> bool:
        return self.config.limit_bytes is None or self.reserved + nbytes <= self.config.limit_bytes

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def alloc_block(self, pool: Pool, size: int, stream: int) -> Block | None:
        if self.config.expandable_segments:
            return self.alloc_expandable(pool, size, stream)
        nbytes = allocation_size(size)
        if not self._fits_limit(nbytes):
            return None
        self._grow(nbytes)
        b = Block(self._next_ptr, nbytes, stream, pool.small, next(self._segment_ids))
        self._next_ptr += nbytes + (1 << 30)  # segments never touch: no merging across them
        return b

    def release_segment(self, b: Block) -> None:
        self.pools[b.small].remove(b)
        self.reserved -= b.size

    def release_available_cached_blocks(self, pool: Pool, size: int, stream: int) -> bool:
        mss = self.config.max_split_size
        if mss == UNLIMITED:
            return False
        want = max(size, mss)
        b = pool.lower_bound(stream, want)
        if b is not None:
            self.release_segment(b)
            return True
        oversize = sorted((x for x in pool if x.stream == stream and x.size >= mss and not x.is_split()),
                          key=Block.key, reverse=True)
        released = 0
        for x in oversize:
            if released >= want:
                break
            released += x.size
            self.release_segment(x)
        return released >= want

    def release_cached_blocks(self) -> bool:
        for pool in self.pools.values():
            for b in list(pool):
                if b.segment in self._expandable_ids:
                    self.unmap(b)
                elif not b.is_split():
                    self.release_segment(b)
        return True

    def garbage_collect(self) -> None:
        assert self.config.limit_bytes is not None  # called only under a limit (malloc)
        threshold = int(self.config.garbage_collection_threshold * self.config.limit_bytes)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        pool = self.pools[False]
        candidates = [b for b in pool if not b.is_split()]
        if not candidates:
            return
        age = lambda b: pool.free_calls - b.gc_base  # noqa: E731
        total, count, freed = sum(age(b) for b in candidates), len(candidates), True
        while reclaimed < target and freed and count > 0:
            threshold_age, freed = total / count, False
            for b in [b for b in pool if not b.is_split()]:
                if age(b) >= threshold_age:
                    freed, reclaimed, total, count = True, reclaimed + b.size, total - age(b), count - 1
                    self.release_segment(b)

    # --- expandable segments ---

    def alloc_expandable(self, pool: Pool, size: int, stream: int) -> Block | None:
        """find_expandable_block + map_block: the lowest unmapped range (with the free block just before it)
        that can hold the request is mapped, page by page, and merged into one free block."""
        key = (pool.small, stream)
        if key not in self._segments:  # address space for the whole GPU: one unmapped block
            seg = next(self._segment_ids)
            self._expandable_ids.add(seg)
            self._segments[key] = Block(self._next_ptr, 1 << 50, stream, pool.small, seg, mapped=False)
            self._next_ptr += 1 << 51
        free = lambda x: x is not None and x.mapped and not x.allocated  # noqa: E731
        candidate = None
        for u in self._blocks(self._segments[key]):
            if u.mapped:
                continue
            c = u.prev if free(u.prev) else u
            room, x = 0, c
            while x is not None and room < size and (free(x) or not x.mapped):
                room, x = room + x.size, x.next
            if room >= size:
                candidate = c
                break
        if candidate is None:
            return None
        if free(candidate):
            pool.remove(candidate)
        else:
            candidate = self.map_block(pool, candidate, min(candidate.size, size))
            if candidate is None:
                return None
        while candidate.size < size:
            nxt = candidate.next
            assert nxt is not None  # the room counted above runs on through these blocks
            mapped = self.map_block(pool, nxt, min(size - candidate.size, nxt.size))
            if mapped is None:
                pool.insert(candidate)
                return None
            candidate = mapped
        return candidate

    def map_block(self, pool: Pool, u: Block, size: int) -> Block | None:
        """Map whole pages from the start of unmapped block u; merge with a free block before it. The result is
        free and out of the pool (the caller takes it)."""
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        nbytes = min(u.size, -(-size // page) * page)
        if not self._fits_limit(nbytes):
            return None
        self._grow(nbytes)
        if nbytes < u.size:
            rest = Block(u.ptr + nbytes, u.size - nbytes, u.stream, u.small, u.segment, mapped=False)
            rest.prev, rest.next = u, u.next
            if u.next is not None:
                u.next.prev = rest
            u.next, u.size = rest, nbytes
        u.mapped = True
        before = u.prev
        if before is not None and before.mapped and not before.allocated:
            self.try_merge(u, before, pool)
            if u.prev is None:
                self._segments[(u.small, u.stream)] = u
        return u

    def unmap(self, b: Block) -> None:
        """unmap_block: the whole pages inside a free block go back; the free bytes around them stay cached."""
        page = SMALL_BUFFER if b.small else LARGE_BUFFER
        base = self._head(b).ptr
        start = base + -(-(b.ptr - base) // page) * page
        end = base + ((b.ptr + b.size - base) // page) * page
        if end <= start:
            return
        pool = self.pools[b.small]
        pool.remove(b)
        self.reserved -= end - start
        pieces = [Block(p, n, b.stream, b.small, b.segment, mapped=m)
                  for p, n, m in ((b.ptr, start - b.ptr, True), (start, end - start, False),
                                  (end, b.ptr + b.size - end, True)) if n > 0]
        prev, nxt = b.prev, b.next
        for x, y in zip(pieces, pieces[1:]):
            x.next, y.prev = y, x
        pieces[0].prev, pieces[-1].next = prev, nxt
        if prev is not None:
            prev.next = pieces[0]
        else:
            self._segments[(b.small, b.stream)] = pieces[0]
        if nxt is not None:
            nxt.prev = pieces[-1]
        hole = next(x for x in pieces if not x.mapped)
        for x in pieces:
            if x.mapped:
                pool.insert(x)
        for other in (hole.prev, hole.next):  # unmapped neighbours join the hole
            if other is not None and not other.mapped:
                self.try_merge(hole, other, pool)
                if hole.prev is None:
                    self._segments[(b.small, b.stream)] = hole

    @staticmethod
    def _blocks(head: Block | None):
        while head is not None:
            yield head
            head = head.next

    @staticmethod
    def _head(b: Block) -> Block:
        while b.prev is not None:
            b = b.prev
        return b


def replay(events, config: AllocatorConfig | None = None, marks: dict[int, str] | None = None) -> dict:
    """Replay ('a', handle, nbytes) / ('f', handle) / ('empty_cache',) events; `marks` maps an event index to
    a phase that starts there (peaks reset, as reset_peak_memory_stats does). Returns the peak reserved and
    allocated per phase (the whole trace under '' when there are no marks)."""
    sim = CachingAllocator(config)
    marks = marks or {0: ""}
    out: dict[str, dict] = {}
    phase = None
    for i, ev in enumerate(itertools.chain(events, [None])):
        if i in marks or ev is None:
            if phase is not None:
                out[phase] = {"peak_reserved": sim.peak_reserved, "peak_allocated": sim.peak_allocated}
            if ev is None:
                break
            phase = marks.get(i, phase)
            sim.reset_peak()
        if ev[0] == "a":
            sim.malloc(ev[1], ev[2])
        elif ev[0] == "f":
            sim.free(ev[1])
        elif ev[0] == "empty_cache":
            sim.empty_cache()
    return out


def replay_cuda_trace(trace: list[dict], config: AllocatorConfig | None = None) -> dict:
    """A real allocator's history (torch.cuda.memory._snapshot()['device_traces'][d], recorded from the
    process's start with _record_memory_history) replayed through this model: the reserved peak the GPU
    showed (segment_alloc / segment_map minus segment_free / segment_unmap) beside the model's, which sees
    only the allocations and frees."""
    sim = CachingAllocator(config)
    real = real_peak = 0
    for e in trace:
        action = e.get("action")
        if action == "alloc":
            sim.malloc(e["addr"], e["size"], e.get("stream", 0))
        elif action == "free_completed":
            sim.free(e["addr"])
        elif action in ("segment_alloc", "segment_map"):
            real += e["size"]
            real_peak = max(real_peak, real)
        elif action in ("segment_free", "segment_unmap"):
            real -= e["size"]
    return {"real_peak_reserved": real_peak, "simulated_peak_reserved": sim.peak_reserved,
            "simulated_peak_allocated": sim.peak_allocated}
