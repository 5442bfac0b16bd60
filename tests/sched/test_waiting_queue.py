"""`WaitingQueue.load`: the per-tenant-id oldest arrival and queued tokens it keeps as requests
come and go equal a pass over the queue, over random pushes, preempted re-pushes (earlier
arrivals, more tokens) and removals, in FIFO mode (several tenant ids in one queue) and keyed
mode, including the heap compaction after many removals."""

from __future__ import annotations

import random

import pytest

from sits.sched.tenants import WaitingQueue
from tests.sched.sched_testlib import make_request


def _brute_load(queue: WaitingQueue) -> dict[str, tuple[float, int]]:
    load: dict[str, tuple[float, int]] = {}
    for request in queue:
        oldest, tokens = load.get(request.tenant_id, (request.arrival_time, 0))
        load[request.tenant_id] = (
            min(oldest, request.arrival_time),
            tokens + len(request.all_token_ids),
        )
    return load


@pytest.mark.parametrize("fifo", [True, False])
def test_load_equals_a_pass_over_the_queue(fifo: bool) -> None:
    rng = random.Random(7)
    queue = WaitingQueue(fifo=fifo)
    queued, out = [], []
    num_checks = 0
    for step in range(3000):
        action = rng.random()
        if action < 0.45 or not queued:  # a new request
            request = make_request(
                f"r{step}",
                [1] * rng.randint(1, 40),
                arrival_time=float(step),
                tenant_id=rng.choice(["a", "b", "c"]) if fifo else "a",
            )
            queue.push(request, (rng.random(), step))
            queued.append(request)
        elif action < 0.6 and out:  # a preempted request comes back with its outputs
            request = out.pop(rng.randrange(len(out)))
            request.append_output_token(5)
            queue.push(request, (rng.random(), step), preempted=True)
            queued.append(request)
        else:  # admitted (sometimes the front, sometimes any) or finished while waiting
            index = 0 if rng.random() < 0.5 else rng.randrange(len(queued))
            request = queued.pop(index)
            queue.remove(request)
            if rng.random() < 0.5:
                out.append(request)
        if step % 7 == 0:
            assert queue.load() == _brute_load(queue)
            num_checks += 1
    assert num_checks > 400 and len(queue) == len(queued)
    for request in list(queued):  # empty again: no tenant id left
        queue.remove(request)
    assert queue.load() == {} == _brute_load(queue)


def test_an_old_request_keeps_its_place_while_many_pass_it() -> None:
    """One long-waiting request under thousands that come and go: its arrival stays the
    oldest, and the stale heap entries are compacted away."""
    queue = WaitingQueue(fifo=False)
    old = make_request("old", [1, 2, 3], arrival_time=1.0)
    queue.push(old, (9.0,))
    for i in range(5000):
        request = make_request(f"r{i}", [1] * 4, arrival_time=2.0 + i)
        queue.push(request, (0.0, i))
        queue.remove(request)
        assert len(queue._arrivals["default"]) <= 2 * (len(queue) + 1) + 16  # not i + 2
    assert queue.load() == {"default": (1.0, 3)}
