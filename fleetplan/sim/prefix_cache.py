"""The simulated engines' prefix cache (vLLM's automatic prefix caching, TensorRT-LLM's KV cache reuse).

One implementation for every simulated engine (the replay's FastCore and the HTTP engine's
BatchCore, both a `fleetplan.sim.batching.BatchState`):

- A request carries the hashes of its prompt's blocks of `PREFIX_BLOCK_TOKENS` (512) tokens, each
  hash naming the block AND everything before it (a trace's `hash_ids`: Mooncake's are chained like
  that; over HTTP `prompt_block_hashes` chains them as vLLM does, hash(parent hash, block tokens)).
  Block i holds tokens [512 i, min(512 (i + 1), prompt)); the last one may be partial.
- The cache holds blocks in the KV memory the engine already models: a cached block costs the KV
  blocks (`block_size` tokens each, 16) of its tokens. Blocks of running requests are PINNED
  (their memory is the request's own KV, counted in its `Seq.blocks`); when a request finishes,
  is preempted or cancelled its blocks are unpinned and stay cached, least recently used first
  out, in the KV memory left free (vLLM's free-block queue: a free block keeps its hash until it
  is reused, so the cache is exactly the free memory). Unpinned in reverse order, so that a
  prompt's tail is evicted before its head (as vLLM's free queue).
- A waiting request's hit is its longest run of leading cached blocks, in tokens, at most the
  prompt minus one token rounded down to the KV block size (vLLM always recomputes the last
  token to get logits: `max_cache_hit_length = num_tokens - 1`, whole blocks). Its prefill
  then computes only the rest (the cached tokens count in its KV memory and attention context).
- A request's blocks enter the cache when its prefill ends (its first token).

Simplifications (docs/sim.md): two running requests sharing cached blocks are charged the shared
blocks' memory twice (vLLM shares them with a reference count); a hit is decided when the request
can next be admitted and holds while it waits; blocks are 512 tokens (the trace's granularity),
so a partial last block is reused only by an identical prompt.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

PREFIX_BLOCK_TOKENS = 512  # tokens per hashed prompt block (Mooncake's hash_ids granularity)


def block_tokens(prompt_tokens: int, i: int, block: int = PREFIX_BLOCK_TOKENS) -> int:
    """Tokens of prompt block i (the last one may be partial; 0 beyond the prompt)."""
    return max(0, min(block, prompt_tokens - block * i))


def prompt_block_hashes(tokens: Sequence[int] | Sequence[str], block: int = PREFIX_BLOCK_TOKENS) -> tuple[int, ...]:
    """Chained hashes of a prompt's blocks of `block` tokens: hash i names block i's tokens AND
    block i-1's hash, so equal hashes mean equal prefixes (vLLM's hash_block_tokens: parent hash,
    block tokens). Tokens are token ids or words (the HTTP engine's tokens for a text prompt).
    Stable across processes (blake2b, not Python's salted hash). Partial last block included."""
    out: list[int] = []
    parent = b""
    for start in range(0, len(tokens), block):
        chunk = tokens[start:start + block]
        h = hashlib.blake2b(parent, digest_size=8)
        if chunk and isinstance(chunk[0], str):
            h.update("\x1f".join(str(t) for t in chunk).encode())
        else:
            h.update(struct.pack(f"<{len(chunk)}q", *(int(t) for t in chunk)))
        parent = h.digest()
        out.append(int.from_bytes(parent, "little") >> 1)  # non-negative, fits int64
    return tuple(out)


class PrefixCache:
    """Cached prompt blocks: pinned ones (held by running requests) and an LRU of unpinned ones
    whose memory (`lru_blocks`, in KV blocks) lives in the engine's free KV blocks.

    `epoch` changes whenever a block enters or leaves the cache (what a lookup depends on)."""

    __slots__ = ("_lru", "_pinned", "epoch", "evicted", "kv_block_size", "lru_blocks")

    def __init__(self, kv_block_size: int) -> None:
        self.kv_block_size = kv_block_size
        self._pinned: dict[int, list[int]] = {}  # hash -> [tokens, pins]
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> tokens, oldest first
        self.lru_blocks = 0
        self.epoch = 0
        self.evicted = 0  # prompt blocks evicted (cumulative)

    def __len__(self) -> int:
        return len(self._pinned) + len(self._lru)

    def __contains__(self, h: int) -> bool:
        return h in self._pinned or h in self._lru

    @property
    def pinned_count(self) -> int:
        return len(self._pinned)

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` in the cache."""
        pinned, lru = self._pinned, self._lru
        n = 0
        for h in hashes:
            if h in pinned or h in lru:
                n += 1
            else:
                break
        return n

    def hit_tokens(self, hashes: Sequence[int], prompt_tokens: int, num_tokens: int) -> tuple[int, int]:
        """(cached tokens, blocks they span) for a request whose prompt has `prompt_tokens` tokens
        and which must compute `num_tokens` (prompt + tokens generated before a preemption): the
        leading cached blocks (up to the first partial one, which ends the cached prefix), at most
        num_tokens - 1 rounded down to the KV block size."""
        pinned, lru = self._pinned, self._lru
        tokens = 0
        for h in hashes:
            e = pinned.get(h)
            t = e[0] if e is not None else lru.get(h)
            if t is None:
                break
            tokens += t
            if t < PREFIX_BLOCK_TOKENS:
                break
        if tokens == 0:
            return 0, 0
        tokens = min(tokens, prompt_tokens)
        bs = self.kv_block_size
        cap = (num_tokens - 1) // bs * bs
        if tokens > cap:
            tokens = cap
        return tokens, -(-tokens // PREFIX_BLOCK_TOKENS)

    def pin(self, hashes: Sequence[int], prompt_tokens: int, start: int = 0, stop: int | None = None) -> None:
        """Pin blocks [start, stop) of a request (inserting the ones not cached yet)."""
        pinned, lru = self._pinned, self._lru
        bs = self.kv_block_size
        new = False
        for i in range(start, len(hashes) if stop is None else stop):
            h = hashes[i]
            e = pinned.get(h)
            if e is not None:
                e[1] += 1
                continue
            tokens = lru.pop(h, None)
            if tokens is not None:
                self.lru_blocks -= -(-tokens // bs)
            else:
                tokens = block_tokens(prompt_tokens, i)
                new = True
            pinned[h] = [tokens, 1]
        if new:
            self.epoch += 1

    def unpin(self, hashes: Sequence[int], count: int) -> None:
        """Unpin a request's first `count` blocks, last first (the tail is evicted first)."""
        pinned, lru = self._pinned, self._lru
        for i in range(count - 1, -1, -1):
            h = hashes[i]
            e = pinned.get(h)
            if e is None:
                continue
            e[1] -= 1
            if e[1] <= 0:
                del pinned[h]
                lru[h] = e[0]
                self.lru_blocks += -(-e[0] // self.kv_block_size)

    def trim(self, free_kv_blocks: int) -> None:
        """Evict least recently used unpinned blocks until they fit in the free KV blocks."""
        if self.lru_blocks <= free_kv_blocks:
            return
        lru = self._lru
        bs = self.kv_block_size
        while self.lru_blocks > free_kv_blocks and lru:
            _h, tokens = lru.popitem(last=False)
            self.lru_blocks -= -(-tokens // bs)
            self.evicted += 1
        self.epoch += 1
