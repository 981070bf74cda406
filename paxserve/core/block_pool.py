"""KV-cache blocks: reference counts, an LRU free list with O(1) removal, and the prefix-cache map.

Pure Python. A freed block keeps its hash (and its KV contents) until it is handed out again, so a
later request with the same prefix can take it back from the free list: that is the prefix cache,
and the free list's order (least recently freed first) is its eviction order.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

NULL_BLOCK_ID = 0
# Versioned so that a change to the key layout can never match keys made by an older layout.
_ROOT_DOMAIN = b"paxserve-kv-block-v1"


@dataclass(frozen=True, slots=True)
class BlockHash:
    """Identity of a full block: sha256 chained over the parent block's key and this block's token
    ids (the first block also over the request's cache salt), plus the token ids themselves so a
    lookup is confirmed against the tokens, not just the digest.

    A cryptographic digest, not Python's `hash`: with a 64-bit hash a tenant can craft prompts whose
    blocks collide with another tenant's and be served KV it never computed (CVE-2025-25183)."""

    value: bytes
    token_ids: tuple[int, ...]


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], cache_salt: str | None = None,
               lora_id: int = 0) -> BlockHash:
    """The key of a full block. `cache_salt` and `lora_id` (the LoRA adapter the block's KV was
    computed with, 0 for the base model) only matter for the first block (parent None): every later
    key chains over them, so requests with different salts or adapters never share any block."""
    tokens = tuple(int(t) for t in token_ids)
    digest = hashlib.sha256()
    if parent is None:
        salt = (cache_salt or "").encode("utf-8")
        # Length-prefixed so that no salt/token split can be read two ways.
        digest.update(_ROOT_DOMAIN + struct.pack("<?I", cache_salt is not None, len(salt)) + salt)
        if lora_id:  # base-model keys stay as they were
            digest.update(struct.pack("<q", lora_id))
    else:
        digest.update(parent.value)
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return BlockHash(digest.digest(), tokens)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Links of the free list; None while the block is in use.
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the front, append at the back, remove any block
    (a prefix-cache hit on a free block) in O(1)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self._len += 1

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free list")
        block.prev_free.next_free, block.next_free.prev_free = block.next_free, block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise RuntimeError("no free KV-cache blocks")
        self.remove(first)
        return first

    def block_ids(self) -> list[int]:
        """Free block ids from the next to be handed out to the last (for tests and debugging)."""
        ids, b = [], self._head.next_free
        while b is not None and b is not self._tail:
            ids.append(b.block_id)
            b = b.next_free
        return ids


class BlockPool:
    """All KV blocks of the cache. Block 0 is the null block: never handed out, target of padding."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # evict: its contents are about to be overwritten
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero join the back of the free list in the given order
        (callers pass a request's blocks tail first, so its last blocks are evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"{block} freed more often than it was allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a block that holds (or, in the step being scheduled, will hold) a full, known run
        of tokens. Returns whether it was registered now."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False  # another block already holds the same tokens; this one stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget a registration whose KV was never written (the step that would have written it failed)."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
