"""Token ids for simulated prompts and outputs, and a session's incrementally hashed context.

The simulator has no tokenizer: prompts are random token ids. What matters is *which* tokens
repeat, because that is what the prefix cache sees. So shared pieces (a system prompt, tool
schemas, a Mooncake hash id's block) are drawn once and reused verbatim, and everything else is
drawn fresh, so two requests share exactly the prefixes the workload means them to share.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from sim.request import ROOT_BLOCK_HASH

DEFAULT_VOCAB_SIZE = 32_000
# Ids below this are left out: most vocabularies put BOS/EOS/PAD and other specials there, and a
# replay on real vLLM must not stop early on a sampled EOS in the prompt.
MIN_TOKEN_ID = 10


@functools.cache
def token_objects(vocab_size: int) -> np.ndarray:
    """The Python ints ``0 .. vocab_size - 1`` as an object array. Token lists taken through
    it hold one shared int object per id, not one per token: an int above 256 is a 28-byte
    object of its own, which made the token ids of a large agent run (every live session's
    context, every queued prompt) its biggest memory cost."""
    objects = np.empty(vocab_size, dtype=object)
    objects[:] = range(vocab_size)
    return objects


class TokenSource:
    """Random token ids in ``[MIN_TOKEN_ID, vocab_size)`` drawn from one generator."""

    __slots__ = ("_rng", "vocab_size")

    def __init__(self, rng: np.random.Generator, vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
        if vocab_size <= MIN_TOKEN_ID:
            raise ValueError(f"vocab_size={vocab_size} must exceed {MIN_TOKEN_ID}")
        self._rng = rng
        self.vocab_size = vocab_size

    def take(self, num_tokens: int) -> list[int]:
        """``num_tokens`` fresh token ids, as a list (what :class:`Request` stores) of shared
        int objects (see :func:`token_objects`)."""
        return self.as_list(self.take_array(num_tokens))

    def as_list(self, token_ids: np.ndarray) -> list[int]:
        """Token ids below ``vocab_size`` (an int array) as a list of shared int objects."""
        return token_objects(self.vocab_size)[token_ids].tolist()

    def take_array(self, num_tokens: int) -> np.ndarray:
        """``num_tokens`` fresh token ids, as an int64 array."""
        return self._rng.integers(MIN_TOKEN_ID, self.vocab_size, size=num_tokens, dtype=np.int64)


class HashIdTokens:
    """The tokens of Mooncake-style ``hash_ids``: block ``h`` depends only on ``(seed, h)``.

    Equal hash ids therefore give equal tokens in any request, whatever order rows are replayed
    in. Blocks are kept in a bounded LRU (int64 arrays) because traces reuse hot prefixes a lot
    and a fresh generator per block costs ~10 us.
    """

    def __init__(
        self,
        seed: int,
        block_tokens: int,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        cache_blocks: int = 16_384,
    ) -> None:
        self.seed = seed
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_blocks = cache_blocks

    def block(self, hash_id: int) -> np.ndarray:
        """The ``block_tokens`` token ids of ``hash_id`` (do not modify the array)."""
        tokens = self._cache.get(hash_id)
        if tokens is not None:
            self._cache.move_to_end(hash_id)
            return tokens
        rng = np.random.default_rng([self.seed, hash_id])
        tokens = rng.integers(MIN_TOKEN_ID, self.vocab_size, size=self.block_tokens)
        self._cache[hash_id] = tokens
        if len(self._cache) > self._cache_blocks:
            self._cache.popitem(last=False)
        return tokens

    def tokens(self, hash_ids: Sequence[int], num_tokens: int) -> np.ndarray:
        """The first ``num_tokens`` tokens of the concatenated blocks of ``hash_ids``."""
        needed = -(-num_tokens // self.block_tokens)
        blocks = [self.block(h) for h in hash_ids[:needed]]
        if not blocks:
            return np.empty(0, dtype=np.int64)
        return np.concatenate(blocks)[:num_tokens]


class Context:
    """A session's append-only token sequence and the hash chain of its full blocks.

    ``block_hashes[i]`` is the hash of block ``i`` chained to block ``i - 1`` exactly as
    :class:`sim.request.Request` computes it, so a request whose prompt is this context can take
    ``block_hashes`` as its ``prompt_block_hashes`` instead of rehashing a 30k-token prompt every
    turn. Each appended token is hashed once over the session's life.
    """

    __slots__ = ("block_hashes", "block_size", "token_ids")

    def __init__(self, block_size: int, token_ids: Sequence[int] = ()) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.block_size = block_size
        self.token_ids: list[int] = []
        self.block_hashes: list[int] = []
        self.append(token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    def append(self, token_ids: Sequence[int]) -> None:
        """Append ``token_ids`` and hash every block they complete."""
        self.token_ids.extend(token_ids)
        self.hash_new_blocks()

    def hash_new_blocks(self) -> None:
        """Hash the full blocks not hashed yet: those :meth:`append` completes, or those of
        tokens a request appended itself (one that adopted this context's lists: see
        :class:`sim.request.Request`, which hashes its own full blocks the same way, so only
        what it did not hash is hashed here, e.g. a real engine's tokens in a replay)."""
        self.block_hashes.extend(
            _chain(
                self._last_hash(),
                self.token_ids,
                len(self.block_hashes) * self.block_size,
                self.block_size,
            )
        )

    def block_hashes_with(self, suffix: Sequence[int]) -> list[int]:
        """The block hashes of ``token_ids + suffix``, leaving this context unchanged.

        For prompts that extend the context without becoming part of it (a fan-out sub-call's
        task, an open-loop request after a shared prefix).
        """
        start = len(self.block_hashes) * self.block_size
        tail = self.token_ids[start:]
        tail.extend(suffix)
        return self.block_hashes + _chain(self._last_hash(), tail, 0, self.block_size)

    def copy(self) -> Context:
        """An independent copy (a session forking the shared system prompt)."""
        other = Context.__new__(Context)
        other.block_size = self.block_size
        other.token_ids = self.token_ids.copy()
        other.block_hashes = self.block_hashes.copy()
        return other

    def _last_hash(self) -> int:
        return self.block_hashes[-1] if self.block_hashes else ROOT_BLOCK_HASH


def _chain(parent: int, token_ids: list[int], start: int, block_size: int) -> list[int]:
    """Hashes of the full blocks of ``token_ids[start:]``, chained from ``parent``."""
    # sim.request.hash_block, inlined: a session hashes every token of its context here.
    hashes = []
    append = hashes.append
    for begin in range(start, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[begin : begin + block_size])))
        append(parent)
    return hashes
