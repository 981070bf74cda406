"""Per-request block tables on top of the block pool, with prefix-cache lookups and counters."""

from __future__ import annotations

from dataclasses import dataclass

from paxserve.core.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block
from paxserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    """Counted once per request, when it is first admitted (not per failed attempt or resume)."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which served from cached blocks

    def record(self, num_tokens: int, num_hit: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Owns which blocks each request holds. Requests only ever grow, or free everything at once
    (finish, abort or preemption)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        # How many of a request's leading blocks are registered in the prefix cache already, so each
        # step registers only the blocks it fills (not every full block again).
        self._num_registered: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()
        # Blocks registered in the prefix cache for the step being scheduled: their KV exists only
        # once that step has run. Whoever runs the step takes them (`take_registered`) and rolls
        # them back if it fails; if it runs, nothing more is needed.
        self._registered: list[KVCacheBlock] = []

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def _hashes(self, request: Request, num_tokens: int) -> list[BlockHash]:
        """Chained hashes of the request's full blocks among its first `num_tokens` tokens; kept
        across preemption so a resumed request need not rehash."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, request.token_ids_slice(i * bs, (i + 1) * bs),
                                     request.cache_salt, request.lora_int_id))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached blocks matching the request's tokens, and how many tokens that
        covers. The last token is always left to compute: its logits are needed. A request still
        collecting prompt logprobs gets no hits (it needs every prompt position's logits), though
        the blocks it computes are registered for others as usual."""
        if not self.enable_caching or request.needs_prompt_logprobs:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in self._hashes(request, request.num_tokens)[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVCacheBlock] | None = None
    ) -> bool:
        """Make room for `num_new_tokens` more tokens (after any prefix hits); False when the pool
        cannot, in which case nothing changed."""
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_new_blocks = cdiv(total, self.block_size) - len(blocks) - len(computed_blocks)
        # Hits on free blocks take them off the free list, so they count against what is free.
        reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - reclaimed:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        if self.enable_caching:
            # Blocks that will be full once this step has run hold known tokens: register them now,
            # so a request scheduled after this one in the same step can share them (the step writes
            # every token's KV before any attention reads it). Until the step has run they are
            # provisional: only requests of this step, or of steps queued behind it on the device,
            # can have hit them, and they share its fate.
            num_full = min(total, request.num_tokens) // self.block_size
            hashes = self._hashes(request, num_full * self.block_size)
            for i in range(self._num_registered.get(request.request_id, 0), num_full):
                if self.pool.cache_block(blocks[i], hashes[i]):
                    self._registered.append(blocks[i])
            self._num_registered[request.request_id] = max(num_full, self._num_registered.get(request.request_id, 0))
        return True

    def take_registered(self) -> list[KVCacheBlock]:
        """The blocks registered since the last call: the scheduled step's, kept by whoever runs it
        so that it can `rollback` exactly those if it fails (steps may overlap)."""
        taken, self._registered = self._registered, []
        return taken

    def rollback(self, blocks: list[KVCacheBlock]) -> None:
        """A step failed: forget the registrations (`take_registered`) whose KV it never wrote, so
        that no later request is served a block of garbage."""
        for block in blocks:
            self.pool.uncache_block(block)
        self._num_registered.clear()  # the next step re-walks each request's blocks once

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the KV cache was recreated, or between benchmark runs)."""
        self.pool.reset_prefix_cache()
        self._registered.clear()
        self._num_registered.clear()

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first so those are evicted first."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def forget(self, request: Request) -> None:
        """Drop the request's hash list once it is finished for good."""
        self.req_hashes.pop(request.request_id, None)

    def num_blocks(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block ids from its `start`-th block on (all of them by default)."""
        return [b.block_id for b in self.req_blocks.get(request_id, [])[start:]]
