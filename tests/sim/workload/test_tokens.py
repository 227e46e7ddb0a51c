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


def test_a_request_that_adopts_a_context_grows_it_and_keeps_a_view_once_released():
    context = Context(4, list(range(10, 20)))  # 10 tokens: 2 full blocks hashed
    request = Request(
        "r",
        context.token_ids,
        3,
        block_size=4,
        output_token_ids=[7, 8, 9],
        prompt_block_hashes=context.block_hashes,
        adopt_prompt=True,
    )
    assert request.token_ids is context.token_ids
    for _ in range(3):
        request.sample_output_token()
    # The request's output and the hash of the block it filled are the context's now.
    assert context.token_ids == [*range(10, 20), 7, 8, 9]
    assert len(context.block_hashes) == 3
    assert context.block_hashes == request_hashes(context.token_ids, 4)
    request.release()
    context.hash_new_blocks()  # nothing left to hash
    assert len(context.block_hashes) == 3
    context.append([1, 2, 3])
    # The released request still reads its own tokens only.
    assert len(request.token_ids) == 13 and request.num_tokens == 13
    assert request.output_token_ids == [7, 8, 9]
    assert request.token_ids[-1] == 9 and list(request.token_ids)[:2] == [10, 11]
    assert request.token_ids == [*range(10, 20), 7, 8, 9]
    assert list(request.block_hashes) == context.block_hashes[:3]
    with pytest.raises(IndexError):
        request.token_ids[13]


def test_tokens_appended_to_an_adopted_context_by_someone_else_are_hashed_on_return():
    # A replay on real vLLM extends the request's token ids without hashing them.
    context = Context(4, [5, 6])
    request = Request(
        "r",
        context.token_ids,
        6,
        block_size=4,
        prompt_block_hashes=context.block_hashes,
        adopt_prompt=True,
    )
    request.token_ids.extend([1, 2, 3, 4, 5, 6])
    request.release()
    context.hash_new_blocks()
    assert context.block_hashes == request_hashes([5, 6, 1, 2, 3, 4, 5, 6], 4)


def test_adopt_prompt_takes_lists_only():
    with pytest.raises(TypeError, match="adopt_prompt takes two lists"):
        Request("r", (1, 2, 3), 1, block_size=4, prompt_block_hashes=[], adopt_prompt=True)
    with pytest.raises(TypeError, match="adopt_prompt takes two lists"):
        Request("r", [1, 2, 3], 1, block_size=4, adopt_prompt=True)
