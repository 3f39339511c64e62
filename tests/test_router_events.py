"""KV-event subscription: sequence tracking, gap replay, resync, restart; real ZMQ sockets."""

from __future__ import annotations

import asyncio
import time

import msgpack
import zmq
import zmq.asyncio
from tests.router_support import async_test

from kvroute import PrefixIndex
from kvroute.events import END_SEQ, EventStats, EventSubscriber, SeqTracker, batch_timestamp

W = 3


def batch(k: int, ts: float = 1760000000.0) -> bytes:
    """Batch number ``k``: one GPU block (root) of 16 tokens unique to ``k``."""
    event = {
        "type": "BlockStored",
        "block_hashes": [10_000 + k],
        "parent_block_hash": None,
        "token_ids": [k * 16 + i for i in range(16)],
        "block_size": 16,
        "medium": "GPU",
    }
    return msgpack.packb([ts, [event], 0])


class FakeReplay:
    def __init__(self, buffer: dict[int, bytes] | None) -> None:
        self.buffer = buffer
        self.asked: list[int] = []

    async def __call__(self, start: int) -> list[tuple[int, bytes]] | None:
        self.asked.append(start)
        if self.buffer is None:
            return None
        return sorted((s, p) for s, p in self.buffer.items() if s >= start)


def tracker(buffer: dict[int, bytes] | None) -> tuple[SeqTracker, PrefixIndex, FakeReplay]:
    index = PrefixIndex()
    replay = FakeReplay(buffer)
    return SeqTracker(index, W, replay, EventStats()), index, replay


async def feed(t: SeqTracker, seqs: list[int]) -> None:
    for s in seqs:
        await t.on_batch(s, batch(s))


@async_test()
async def test_in_order_batches_apply_without_replay() -> None:
    t, index, replay = tracker({0: batch(0)})
    await t.on_connect()  # replays 0
    await feed(t, [0, 1, 2])  # 0 is a duplicate of the replayed batch
    assert index.worker_entries(W) == 3
    assert (t.stats.duplicates, t.stats.gaps, t.stats.resyncs, t.last) == (1, 0, 1, 2)
    assert replay.asked == [0]


@async_test()
async def test_gap_is_replayed() -> None:
    buf = {s: batch(s) for s in range(6)}
    t, index, replay = tracker(buf)
    await t.on_connect()
    buf.update({s: batch(s) for s in range(6, 12)})
    await feed(t, [6, 9, 10])  # 7 and 8 lost
    assert replay.asked == [0, 7]
    assert index.worker_entries(W) == 11
    assert (t.stats.gaps, t.stats.missed_batches, t.stats.resyncs) == (1, 2, 1)


@async_test()
async def test_gap_older_than_the_buffer_resyncs() -> None:
    t, index, _ = tracker({})
    await t.on_connect()
    await feed(t, [0, 1])
    t.replay = FakeReplay({s: batch(s) for s in range(4, 8)})  # buffer lost 2..3
    await feed(t, [6])
    assert t.stats.resyncs == 2  # connect + unreplayable gap
    assert index.worker_entries(W) == 3  # 0 and 1 cleared; 4, 5 replayed, 6 live


@async_test()
async def test_gap_without_replay_clears_the_engine() -> None:
    t, index, _ = tracker(None)
    await feed(t, [0, 1])
    await feed(t, [5])
    assert index.worker_entries(W) == 1
    assert t.stats.replay_failures == 2  # new-stream resync and the gap


@async_test()
async def test_sequence_restart_resyncs() -> None:
    t, index, _ = tracker({})
    await t.on_connect()
    await feed(t, [0, 1, 2, 3])
    t.replay = FakeReplay({0: batch(100)})
    await t.on_batch(1, batch(101))  # the engine restarted: its batch 0 was lost, replay has it
    assert t.stats.restarts == 1
    assert index.worker_entries(W) == 2


@async_test()
async def test_restart_inside_a_replayed_range_is_not_taken_for_a_duplicate() -> None:
    t, index, _ = tracker({0: batch(0), 1: batch(1), 2: batch(2)})
    await t.on_connect()
    assert index.worker_entries(W) == 3
    t.replay = FakeReplay({})
    await t.on_batch(0, batch(50))  # same seq, different bytes: a new engine
    assert (t.stats.restarts, t.stats.duplicates) == (1, 0)
    assert index.worker_entries(W) == 1


@async_test()
async def test_malformed_batch_is_counted_and_skipped() -> None:
    t, index, _ = tracker({})
    await t.on_connect()
    await t.on_batch(0, b"\xc1")
    await feed(t, [1])
    assert (t.stats.malformed, t.last, index.worker_entries(W)) == (1, 1, 1)


def test_batch_timestamp() -> None:
    assert batch_timestamp(batch(0, ts=12.5)) == 12.5
    assert batch_timestamp(b"\x93\x01") is None


class Publisher:
    """A minimal vLLM-0.33-style publisher: PUB [topic, seq, payload] and a ROUTER replay socket."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.task = asyncio.get_running_loop().create_task(self._serve_replays())

    @property
    def endpoints(self) -> tuple[str, str]:
        return (
            self.pub.getsockopt(zmq.LAST_ENDPOINT).decode(),
            self.router.getsockopt(zmq.LAST_ENDPOINT).decode(),
        )

    async def publish(self, *, drop: bool = False) -> None:
        payload = batch(self.seq, ts=time.time())
        self.buffer.append((self.seq, payload))
        if not drop:
            await self.pub.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    async def _serve_replays(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.router.send_multipart([ident, b"", b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([ident, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self.task.cancel()
        self.pub.close(0)
        self.router.close(0)


async def wait_for(cond: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


@async_test(30)
async def test_subscriber_over_real_sockets_replays_dropped_batches() -> None:
    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx)
    index = PrefixIndex()
    for _ in range(3):
        await pub.publish()  # before the subscriber exists: only the replay has them
    events, replay = pub.endpoints
    sub = EventSubscriber(ctx, index, W, events, replay, replay_timeout_s=2.0)
    sub.start()
    try:
        await wait_for(lambda: sub.stats.connected and index.worker_entries(W) == 3)
        await asyncio.sleep(0.2)  # let the subscription reach the publisher
        await pub.publish()
        await pub.publish(drop=True)
        await pub.publish(drop=True)
        await pub.publish()
        await wait_for(lambda: sub.stats.last_seq == 6)
        assert index.worker_entries(W) == 7
        assert sub.stats.gaps == 1
        assert sub.stats.lag_s < 5
    finally:
        await sub.stop()
        pub.close()
        ctx.term()


@async_test(30)
async def test_replay_timeout_and_missing_socket() -> None:
    ctx = zmq.asyncio.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.bind("tcp://127.0.0.1:*")
    ep = silent.getsockopt(zmq.LAST_ENDPOINT).decode()
    sub = EventSubscriber(ctx, PrefixIndex(), W, "tcp://127.0.0.1:1", ep, replay_timeout_s=0.2)
    try:
        assert await sub.replay(0) is None
        sub.replay_endpoint = None
        assert await sub.replay(0) is None
    finally:
        silent.close(0)
        ctx.term()
