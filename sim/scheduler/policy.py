"""Scheduling policies: the order of the waiting queue and the choice of preemption victim.

vLLM V1 (``vllm/v1/core/sched/request_queue.py`` and ``scheduler.py``):

- ``fcfs``: waiting is a deque in arrival order; a preempted request goes back to its *front*;
  the victim is the last running request (the most recently admitted).
- ``priority``: waiting is a heap on (priority, arrival time, request id), lower first; a
  preempted request is simply pushed back; the victim is the running request with the
  largest (priority, arrival time). A waiting high-priority request never preempts anyone:
  preemption only happens when a *running* request cannot get blocks.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import ClassVar, Protocol

from sim.request import Request


class WaitingQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class SchedulingPolicy(Protocol):
    name: ClassVar[str]

    def new_waiting_queue(self) -> WaitingQueue: ...
    def victim_index(self, running: list[Request]) -> int: ...
    def ahead_of_swapped(self, request: Request, swapped_head: Request) -> bool: ...


class FcfsQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    prepend = add  # a heap has no front: a preempted request re-enters by its key

    def peek(self) -> Request:
        return self._heap[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


class FcfsPolicy:
    name: ClassVar[str] = "fcfs"

    def new_waiting_queue(self) -> WaitingQueue:
        return FcfsQueue()

    def victim_index(self, running: list[Request]) -> int:
        return len(running) - 1

    def ahead_of_swapped(self, request: Request, swapped_head: Request) -> bool:
        """Swap preemption (a what-if): whether a waiting request is admitted while a
        swapped one waits. FCFS: never (vLLM V0: swapped requests resume first)."""
        return False


class PriorityPolicy:
    name: ClassVar[str] = "priority"

    def new_waiting_queue(self) -> WaitingQueue:
        return PriorityQueue()

    def victim_index(self, running: list[Request]) -> int:
        # max() keeps the first of equal keys, as vLLM's max(self.running, key=...) does.
        worst = max(running, key=lambda r: (r.priority, r.arrival_time_s))
        return running.index(worst)

    def ahead_of_swapped(self, request: Request, swapped_head: Request) -> bool:
        """Swap preemption (a what-if): a waiting request that sorts before the swapped
        queue's head is admitted ahead of it (kvsim's choice: V0 made every new request
        wait for the swapped queue, which would put interactive turns behind swapped
        background agents)."""
        return request < swapped_head


POLICIES: dict[str, type[SchedulingPolicy]] = {p.name: p for p in (FcfsPolicy, PriorityPolicy)}


def make_policy(name: str) -> SchedulingPolicy:
    """The policy registered under ``name``; an unknown name lists the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"scheduling_policy={name!r} is unknown; known policies: {', '.join(POLICIES)}"
        ) from None
