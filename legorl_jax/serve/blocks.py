"""Host-side bookkeeping of the KV block pool: which blocks are free, which
rows own which, and automatic prefix caching.

A full block whose K/V has been computed is registered under a key of its
tokens and of the block before it (its whole prefix, exactly: no hash can
collide). A new request walks its prompt block by block and reuses every
registered block it finds, so it prefills only what follows them. Blocks no
row holds stay registered and are evicted least recently used first when a
new block is needed. `reset` forgets every key: after a weight update no
request can be served K/V computed by older weights. With `caching` off
nothing is registered or reused; lookups are still counted (all misses).

Block 0 is never handed out: it fills the unused entries of block tables.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

NULL_BLOCK = 0

# The prefix a block ends: (block before it, that block's generation, its tokens).
# The generation changes whenever a block is reused, so a key never names
# content a block no longer holds.
BlockKey = tuple[int, int, tuple[int, ...]]
_ROOT = (-1, 0)


class BlockPool:
    """`num_blocks` blocks of `block_size` positions (block 0 reserved); prefix
    caching unless `caching` is False."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"need >= 2 blocks of >= 1 position, got {num_blocks} of {block_size}")
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self._free: deque[int] = deque(range(1, num_blocks))
        self._idle: OrderedDict[int, None] = OrderedDict()  # registered, held by no row; LRU first
        self._refs = [0] * num_blocks
        self._gen = [0] * num_blocks
        self._by_key: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def capacity(self) -> int:
        """Blocks rows can hold at once."""
        return self.num_blocks - 1

    @property
    def used(self) -> int:
        """Blocks held by rows."""
        return self.capacity - len(self._free) - len(self._idle)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _key(self, parent: int | None, tokens: Sequence[int]) -> BlockKey:
        at = _ROOT if parent is None else (parent, self._gen[parent])
        return (*at, tuple(tokens))

    def _chunks(self, tokens: Sequence[int], limit: int) -> list[Sequence[int]]:
        size = self.block_size
        return [tokens[i * size : (i + 1) * size] for i in range(limit // size)]

    def allocate(self, prompt: Sequence[int], reserve: int, reuse: bool) -> tuple[list[int], int] | None:
        """Blocks for `reserve` positions of a request, and how many prompt
        tokens they already hold; None when the pool cannot take it now.

        With `reuse`, registered blocks of the prompt's prefix are shared. The
        last prompt token is always recomputed: its logits are what gets sampled.
        """
        matched: list[int] = []
        if reuse and self.caching:
            parent = None
            for chunk in self._chunks(prompt, len(prompt) - 1):
                block = self._by_key.get(self._key(parent, chunk))
                if block is None:
                    break
                matched.append(block)
                parent = block
        fresh = self.blocks_for(reserve) - len(matched)
        idle_matched = sum(b in self._idle for b in matched)
        if fresh > len(self._free) + len(self._idle) - idle_matched:
            return None
        for block in matched:
            self._idle.pop(block, None)
            self._refs[block] += 1
        blocks = matched + [self._take() for _ in range(fresh)]
        if reuse:
            self.queried_tokens += len(prompt)
            self.hit_tokens += len(matched) * self.block_size
        return blocks, len(matched) * self.block_size

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._idle.popitem(last=False)
            del self._by_key[self._key_of.pop(block)]
        self._gen[block] += 1
        self._refs[block] = 1
        return block

    def register(
        self, blocks: Sequence[int], tokens: Sequence[int], computed: int, walked: int, parent: int | None
    ) -> tuple[int, int | None]:
        """Registers the full blocks among a row's first `computed` positions,
        continuing after the `walked` blocks done before, whose chain ends at
        `parent`. Returns the new (walked, parent)."""
        if not self.caching:
            return walked, parent
        size = self.block_size
        for i in range(walked, computed // size):
            block = blocks[i]
            if block not in self._key_of:
                key = self._key(parent, tokens[i * size : (i + 1) * size])
                # Same prefix computed twice: later blocks chain on the registered copy.
                block = self._by_key.setdefault(key, block)
                self._key_of.setdefault(block, key)
            parent = block
            walked = i + 1
        return walked, parent

    def release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._idle[block] = None
                else:
                    self._free.append(block)

    def reset(self) -> None:
        """Forgets every registered prefix; blocks rows hold stay theirs."""
        self._by_key.clear()
        self._key_of.clear()
        self._free.extend(self._idle)
        self._idle.clear()
