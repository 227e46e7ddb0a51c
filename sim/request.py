"""A request as the scheduler sees it: token ids, block hashes, and one lifecycle.

Mirrors ``vllm/v1/request.py``: ``num_computed_tokens`` chases ``num_tokens``; the request is
hashed block by block as tokens arrive, so the prefix cache can match any full block of the
prompt *and* of the output (a preempted request re-hits its own blocks).
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, cast, overload

if TYPE_CHECKING:
    from sim.workload.base import SessionHint

# Parent hash of a request's first block. An int, not None: hash(None) is not stable across
# processes on Python 3.11, and kvsim results must be.
ROOT_BLOCK_HASH = 0

# ``Request.lazy_finish`` of a request that is not a lazy decode (no step is that late).
NOT_LAZY = 1 << 62


def hash_block(parent_hash: int, block_token_ids: Sequence[int]) -> int:
    """Hash one full block, chained to its parent, as vLLM's ``hash_block_tokens`` does.

    Python's tuple-of-int hash is deterministic across processes (only str/bytes hashing is
    salted), which keeps runs reproducible without paying for sha256.
    """
    return hash((parent_hash, tuple(block_token_ids)))


class RequestStatus(enum.Enum):
    """Where a request is in its lifecycle (vLLM's names)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # CPU offload tier only: blocks given, waiting for their load from host memory.
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"


class ListPrefix(Sequence[int]):
    """A read-only view of the first ``len(items)`` items of a list that goes on growing:
    what a finished request keeps of a session context it adopted (:meth:`Request.release`)."""

    __slots__ = ("_items", "_length")

    def __init__(self, items: list[int]) -> None:
        self._items = items
        self._length = len(items)

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self._items[: self._length][index]
        position = index + self._length if index < 0 else index
        if not 0 <= position < self._length:
            raise IndexError(f"index {index} out of range for {self._length} items")
        return self._items[position]

    def __iter__(self) -> Iterator[int]:
        return iter(self._items[: self._length])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ListPrefix):
            other = list(other)
        return isinstance(other, list) and self._items[: self._length] == other

    def __repr__(self) -> str:
        return f"ListPrefix({self._items[: self._length]!r})"


class Request:
    """One generation request: a prompt and a planned number of output tokens.

    ``output_token_ids`` are chosen by the workload in advance (the simulator has no sampler):
    the engine appends them one per decode step, and an agent session puts the same tokens
    into the next turn's prompt so the prefix cache sees real sharing.
    """

    __slots__ = (
        "_planned_output",
        "arrival_time_s",
        "block_hashes",
        "block_size",
        "lazy_finish",
        "lazy_step",
        "lazy_until",
        "max_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "priority",
        "request_id",
        "session_hint",
        "status",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        block_size: int,
        arrival_time_s: float = 0.0,
        priority: int = 0,
        output_token_ids: Sequence[int] | None = None,
        prompt_block_hashes: Sequence[int] | None = None,
        session_hint: SessionHint | None = None,
        adopt_prompt: bool = False,
    ) -> None:
        """``adopt_prompt``: take ``prompt_token_ids`` and ``prompt_block_hashes`` (lists) as
        this request's own ``token_ids`` and ``block_hashes`` instead of copying them; the
        request extends them with its output tokens and their block hashes (an agent session
        hands over its context, which the turn's output then ends up in), and
        :meth:`release` gives them back."""
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: prompt_token_ids is empty")
        if adopt_prompt and not (
            type(prompt_token_ids) is list and type(prompt_block_hashes) is list
        ):
            raise TypeError(f"request {request_id}: adopt_prompt takes two lists")
        if max_tokens < 1:
            raise ValueError(f"request {request_id}: max_tokens={max_tokens} must be >= 1")
        if output_token_ids is not None and len(output_token_ids) < max_tokens:
            raise ValueError(
                f"request {request_id}: {len(output_token_ids)} planned output tokens for "
                f"max_tokens={max_tokens}"
            )
        self.request_id = request_id
        self.token_ids: list[int] = (
            cast(list[int], prompt_token_ids) if adopt_prompt else list(prompt_token_ids)
        )
        self.num_prompt_tokens = len(self.token_ids)
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.arrival_time_s = arrival_time_s
        self.priority = priority
        self._planned_output = output_token_ids
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # A lazy decode (the scheduler's fast path, see Scheduler.enable_lazy_decodes): the
        # step its token ids, computed tokens and token times were last brought up to date
        # (-1: they are current), the step at which it must be scheduled one by one again
        # (0 when not lazy), and the step whose sampled token would finish it.
        self.lazy_step = -1
        self.lazy_until = 0
        self.lazy_finish = NOT_LAZY
        # Which session sent it and whether it comes back (only KV retention reads it).
        self.session_hint = session_hint
        self.block_hashes: list[int] = []
        if prompt_block_hashes is not None:
            # The workload already hashed this prefix (a session's context is append-only).
            num_full = self.num_prompt_tokens // block_size
            assert len(prompt_block_hashes) == num_full, "prompt_block_hashes length mismatch"
            self.block_hashes = (
                cast(list[int], prompt_block_hashes) if adopt_prompt else list(prompt_block_hashes)
            )
        else:
            self._hash_new_full_blocks()

    # -- tokens -------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def next_output_token_id(self) -> int:
        """The token the (simulated) sampler emits next."""
        i = len(self.token_ids) - self.num_prompt_tokens
        if self._planned_output is not None:
            return self._planned_output[i]
        # No plan: a token that depends on the request and position only (crc32, not hash():
        # str hashing is salted per process).
        return zlib.crc32(f"{self.request_id}:{i}".encode()) & 0x7FFF

    def sample_output_token(self) -> None:
        """Append the token the (simulated) sampler emits next: the same token and block
        hashes as ``append_output_token_id(next_output_token_id())``, in one call (every
        decoding request, every step)."""
        tokens = self.token_ids
        planned = self._planned_output
        if planned is None:
            tokens.append(self.next_output_token_id())
        else:
            tokens.append(planned[len(tokens) - self.num_prompt_tokens])
        if len(tokens) % self.block_size == 0:
            self._hash_new_full_blocks()

    def append_output_token_id(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if len(self.token_ids) % self.block_size == 0:
            self._hash_new_full_blocks()

    def append_output_token_ids(self, num_tokens: int) -> None:
        """Sample ``num_tokens`` tokens at once (a decode stretch): the same tokens and block
        hashes as ``num_tokens`` calls of ``append_output_token_id(next_output_token_id())``."""
        start = len(self.token_ids) - self.num_prompt_tokens
        if self._planned_output is not None:
            self.token_ids.extend(self._planned_output[start : start + num_tokens])
        else:
            prefix = self.request_id
            self.token_ids.extend(
                zlib.crc32(f"{prefix}:{i}".encode()) & 0x7FFF
                for i in range(start, start + num_tokens)
            )
        if len(self.token_ids) // self.block_size > len(self.block_hashes):
            self._hash_new_full_blocks()

    def _hash_new_full_blocks(self) -> None:
        bs = self.block_size
        hashes = self.block_hashes
        parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
        tokens = self.token_ids
        for start in range(len(hashes) * bs, len(tokens) - bs + 1, bs):
            parent = hash_block(parent, tokens[start : start + bs])
            hashes.append(parent)

    # -- lifecycle ----------------------------------------------------------------------------
    def mark_running(self, num_computed_tokens: int) -> None:
        """WAITING/PREEMPTED -> RUNNING, starting from ``num_computed_tokens`` (prefix hit)."""
        assert self.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), self.status
        self.status = RequestStatus.RUNNING
        self.num_computed_tokens = num_computed_tokens

    def mark_preempted(self) -> None:
        """RUNNING -> PREEMPTED: recompute from scratch when re-admitted."""
        assert self.status is RequestStatus.RUNNING, self.status
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.num_preemptions += 1

    def mark_finished(self) -> None:
        """RUNNING -> FINISHED_LENGTH_CAPPED (outputs are pinned to max_tokens)."""
        assert self.status is RequestStatus.RUNNING, self.status
        self.status = RequestStatus.FINISHED_LENGTH_CAPPED

    def release(self) -> None:
        """Give back the lists adopted with ``adopt_prompt`` once the request has finished
        (their owner goes on appending to them): ``token_ids`` and ``block_hashes`` become
        read-only views (:class:`ListPrefix`) of what they hold now."""
        self.token_ids = ListPrefix(self.token_ids)  # type: ignore[assignment]
        self.block_hashes = ListPrefix(self.block_hashes)  # type: ignore[assignment]

    def sort_key(self) -> tuple[int, float, str]:
        """Priority order (lower first), as ``vllm.v1.request.Request.__lt__``."""
        return (self.priority, self.arrival_time_s, self.request_id)

    def __lt__(self, other: Request) -> bool:
        return self.sort_key() < other.sort_key()

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed="
            f"{self.num_computed_tokens}/{self.num_tokens})"
        )
