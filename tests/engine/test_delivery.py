"""`BatchedDelivery`: outputs reach the request queues in order, a batch per loop iteration."""

from __future__ import annotations

import asyncio
import socket

import pytest

from sits.engine.async_llm import BatchedDelivery


def _delivered(queues: list[asyncio.Queue]) -> int:
    return sum(q.qsize() for q in queues)


def test_a_batch_per_iteration_in_order() -> None:
    async def main() -> list[list[int]]:
        queues = [asyncio.Queue() for _ in range(3)]
        delivery = BatchedDelivery(batch=2)
        delivery.put([(queues[i % 3], i) for i in range(5)])  # step 1: items 0-4
        counts = [_delivered(queues)]
        delivery.put([(queues[i % 3], i) for i in range(5, 7)])  # step 2 queues behind step 1
        counts.append(_delivered(queues))
        for _ in range(4):
            await asyncio.sleep(0)  # one loop iteration
            counts.append(_delivered(queues))
        assert counts == [2, 2, 4, 6, 7, 7] and len(delivery) == 0
        return [[q.get_nowait() for _ in range(q.qsize())] for q in queues]

    assert asyncio.run(main()) == [[0, 3, 6], [1, 4], [2, 5]]


def test_the_loop_polls_its_sockets_between_batches() -> None:
    """A readable socket's callback runs while a backlog of 64 is being handed over; handed
    over at once (batch 64), the backlog is gone before the loop polls again."""

    async def seen_by_reader(batch: int) -> int:
        loop = asyncio.get_running_loop()
        left, right = socket.socketpair()
        queue: asyncio.Queue = asyncio.Queue()
        seen: list[int] = []
        loop.add_reader(left.fileno(), lambda: seen.append(queue.qsize()))
        try:
            right.send(b"x")  # readable from the next poll on
            BatchedDelivery(batch=batch).put([(queue, i) for i in range(64)])
            while not seen:
                await asyncio.sleep(0)
            return seen[0]
        finally:
            loop.remove_reader(left.fileno())
            left.close()
            right.close()

    assert asyncio.run(seen_by_reader(64)) == 64
    assert 8 <= asyncio.run(seen_by_reader(8)) < 64


def test_flush_hands_over_everything_now() -> None:
    async def main() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        delivery = BatchedDelivery(batch=1)
        delivery.put([(queue, i) for i in range(4)])
        assert (queue.qsize(), len(delivery)) == (1, 3)
        delivery.flush()
        queue.put_nowait("error")  # what `_fail_request` does next: after the outputs
        assert [queue.get_nowait() for _ in range(5)] == [0, 1, 2, 3, "error"]
        await asyncio.sleep(0)  # the drain scheduled before the flush finds nothing
        assert queue.qsize() == 0

    asyncio.run(main())


def test_a_backlog_left_by_an_ended_loop_is_drained_by_the_next() -> None:
    queue: asyncio.Queue = asyncio.Queue()
    delivery = BatchedDelivery(batch=1)

    async def put(items: list[int], iterations: int) -> None:
        delivery.put([(queue, i) for i in items])
        for _ in range(iterations):
            await asyncio.sleep(0)

    first = asyncio.new_event_loop()
    first.run_until_complete(put([0, 1, 2, 3], 0))  # stops with a drain scheduled on it
    first.close()
    assert (queue.qsize(), len(delivery)) == (2, 2)
    asyncio.run(put([4], 5))  # a new loop takes the backlog over
    assert [queue.get_nowait() for _ in range(5)] == [0, 1, 2, 3, 4]


def test_outside_a_loop_everything_goes_at_once() -> None:
    queue: asyncio.Queue = asyncio.Queue()
    BatchedDelivery(batch=1).put([(queue, i) for i in range(3)])
    assert queue.qsize() == 3


def test_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="batch must be >= 1"):
        BatchedDelivery(batch=0)
