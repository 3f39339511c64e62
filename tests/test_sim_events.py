"""The KV-event publisher's wire behaviour: frames, bind-or-connect, replay, gaps, restart."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import zmq
import zmq.asyncio

from kvroute.sim.events import END_SEQ, EventPublisher, should_bind

# vLLM's own encoding of the batch (ts=1.5, dp=0, events=[AllBlocksCleared]) (from vllm.md).
GOLDEN = bytes.fromhex("93cb3ff80000000000009181a474797065b0416c6c426c6f636b73436c656172656400")
TIMEOUT_MS = 2000


def run(coro_fn: Callable[[zmq.asyncio.Context], Awaitable[None]]) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            await asyncio.wait_for(coro_fn(ctx), 20)
        finally:
            ctx.destroy(linger=0)

    asyncio.run(main())


@asynccontextmanager
async def publisher(ctx: zmq.asyncio.Context, **kw: object) -> AsyncIterator[EventPublisher]:
    kw.setdefault("replay_endpoint", "tcp://127.0.0.1:*")
    pub = EventPublisher(ctx, str(kw.pop("endpoint", "tcp://127.0.0.1:*")), **kw)  # type: ignore[arg-type]
    pub.start()
    try:
        yield pub
    finally:
        await pub.aclose()


async def recv(sock: zmq.asyncio.Socket) -> list[bytes]:
    if not await sock.poll(TIMEOUT_MS):
        raise AssertionError("no message within the timeout")
    return list(await sock.recv_multipart())


async def subscribed(ctx: zmq.asyncio.Context, pub: EventPublisher, topic: bytes = b"") -> zmq.asyncio.Socket:
    """A SUB socket that is known to receive: probes are published until one arrives (PUB/SUB
    drops everything sent before the subscription reaches the publisher)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(pub.endpoint)
    for _ in range(200):
        await pub.publish(b"probe")
        if await sub.poll(10):
            while await sub.poll(50):
                await sub.recv_multipart()
            return sub
    raise AssertionError("the subscription never took effect")


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies = []
        while True:
            frames = await recv(dealer)
            replies.append(frames)
            if frames[-1] == b"":  # the end marker has an empty payload
                return replies
    finally:
        dealer.close(linger=0)


@pytest.mark.parametrize(
    ("endpoint", "bind"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("tcp://127.0.0.1:*", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://router.local:5557", False),
    ],
)
def test_bind_or_connect_rule(endpoint: str, bind: bool) -> None:
    assert should_bind(endpoint) is bind


def test_frames_are_topic_seq_payload() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        async with publisher(ctx, topic="kv") as pub:
            assert pub.endpoint.startswith("tcp://127.0.0.1:")
            sub = await subscribed(ctx, pub)
            first = pub.next_seq
            for _ in range(3):
                await pub.publish(GOLDEN)
            for i in range(3):
                topic, seq, payload = await recv(sub)
                assert topic == b"kv"
                assert len(seq) == 8
                assert int.from_bytes(seq, "big") == first + i
                assert payload == GOLDEN
            sub.close(linger=0)

    run(body)


def test_replay_returns_buffered_batches_then_end_marker() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        async with publisher(ctx, topic="kv", buffer_steps=3) as pub:
            assert pub.replay_endpoint is not None
            for i in range(5):
                await pub.publish(bytes([i]))
            replies = await replay(ctx, pub.replay_endpoint, 3)
            assert replies == [
                [b"", b"kv", (3).to_bytes(8, "big"), bytes([3])],
                [b"", b"kv", (4).to_bytes(8, "big"), bytes([4])],
                [b"", b"", END_SEQ, b""],
            ]
            # A start older than the buffer silently starts later: at the oldest kept batch, 2.
            older = await replay(ctx, pub.replay_endpoint, 0)
            assert [int.from_bytes(r[2], "big") for r in older[:-1]] == [2, 3, 4]
            assert older[-1] == [b"", b"", b"\xff" * 8, b""]
            # A start past the newest gives just the marker.
            assert await replay(ctx, pub.replay_endpoint, 99) == [[b"", b"", END_SEQ, b""]]

    run(body)


def test_dropped_batches_leave_gaps_but_stay_replayable() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        async with publisher(ctx) as pub:
            assert pub.replay_endpoint is not None
            sub = await subscribed(ctx, pub)
            a = await pub.publish(b"a")
            b = await pub.publish(b"b", drop=True)
            c = await pub.publish(b"c")
            assert (b, c) == (a + 1, a + 2)
            seqs = [int.from_bytes((await recv(sub))[1], "big") for _ in range(2)]
            assert seqs == [a, c]  # the subscriber sees the gap at b
            assert not await sub.poll(100)
            assert pub.dropped == 1
            replies = await replay(ctx, pub.replay_endpoint, b)
            assert [r[3] for r in replies] == [b"b", b"c", b""]
            sub.close(linger=0)

    run(body)


def test_reset_restarts_seq_at_zero_and_clears_replay() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        async with publisher(ctx) as pub:
            assert pub.replay_endpoint is not None
            sub = await subscribed(ctx, pub)
            await pub.publish(b"before")
            await recv(sub)
            pub.reset()
            assert await replay(ctx, pub.replay_endpoint, 0) == [[b"", b"", END_SEQ, b""]]
            assert await pub.publish(b"after") == 0
            _, seq, payload = await recv(sub)
            assert (int.from_bytes(seq, "big"), payload) == (0, b"after")
            sub.close(linger=0)

    run(body)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_concrete_endpoint_connects_to_a_bound_sub() -> None:
    async def body(ctx: zmq.asyncio.Context) -> None:
        port = free_port()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind(f"tcp://127.0.0.1:{port}")  # the router's side binds; replicas connect in
        async with publisher(ctx, endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=None) as pub:
            assert pub.endpoint == f"tcp://127.0.0.1:{port}"
            assert pub.replay_endpoint is None
            for _ in range(200):
                await pub.publish(b"x")
                if await sub.poll(10):
                    break
            else:
                raise AssertionError("nothing arrived over the connected PUB")
            assert (await recv(sub))[2] == b"x"
        sub.close(linger=0)

    run(body)
