import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.request import Request
from sim.workload.tokens import MIN_TOKEN_ID, Context, HashIdTokens, TokenSource


def request_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """What Request computes when it hashes the prompt itself."""
    return Request("r", token_ids, 1, block_size=block_size).block_hashes


@given(
    block_size=st.integers(1, 8),
    pieces=st.lists(st.lists(st.integers(0, 50), min_size=0, max_size=20), max_size=8),
)
def test_context_hashes_match_request_after_every_append(block_size, pieces):
    context = Context(block_size)
    expected_tokens: list[int] = []
    for piece in pieces:
        context.append(piece)
        expected_tokens += piece
        assert context.token_ids == expected_tokens
        assert len(context.block_hashes) == len(expected_tokens) // block_size
        if expected_tokens:
            assert context.block_hashes == request_hashes(expected_tokens, block_size)


@given(
    block_size=st.integers(1, 8),
    base=st.lists(st.integers(0, 50), min_size=1, max_size=30),
    suffix=st.lists(st.integers(0, 50), max_size=30),
)
def test_block_hashes_with_suffix_matches_request_and_leaves_context(block_size, base, suffix):
    context = Context(block_size, base)
    before = (list(context.token_ids), list(context.block_hashes))
    assert context.block_hashes_with(suffix) == request_hashes(base + suffix, block_size)
    assert (context.token_ids, context.block_hashes) == before


def test_context_copy_is_independent():
    context = Context(4, [1, 2, 3, 4, 5])
    fork = context.copy()
    fork.append([6, 7, 8])
    assert len(context) == 5 and len(context.block_hashes) == 1
    assert len(fork) == 8 and fork.block_hashes[0] == context.block_hashes[0]
    assert len(fork.block_hashes) == 2


def test_context_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size=0"):
        Context(0)


def test_token_source_range_and_determinism():
    draws = TokenSource(np.random.default_rng(3), vocab_size=20).take(5000)
    assert min(draws) == MIN_TOKEN_ID and max(draws) == 19
    assert TokenSource(np.random.default_rng(3), vocab_size=20).take(5000) == draws
    with pytest.raises(ValueError, match="vocab_size=10"):
        TokenSource(np.random.default_rng(), vocab_size=10)


def test_hash_id_tokens_depend_on_seed_and_id_only():
    a = HashIdTokens(seed=1, block_tokens=8, cache_blocks=2)
    b = HashIdTokens(seed=1, block_tokens=8)
    for h in (5, 6, 7, 5):  # 5 is evicted from a's small cache and regenerated
        assert a.block(h).tolist() == b.block(h).tolist()
    assert a.block(5).tolist() != a.block(6).tolist()
    assert HashIdTokens(seed=2, block_tokens=8).block(5).tolist() != a.block(5).tolist()
    tokens = a.tokens([5, 6, 7], 20)
    assert tokens.tolist() == a.block(5).tolist() + a.block(6).tolist() + a.block(7)[:4].tolist()
    assert a.tokens([], 10).size == 0
