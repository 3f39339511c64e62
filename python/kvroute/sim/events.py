"""KV-event publishing exactly as vLLM 0.33's ``ZmqEventPublisher`` does it.

* A ``PUB`` socket sends each batch as ``[topic, seq (8-byte big-endian), payload]``; ``seq`` counts
  batches from 0. The socket *binds* when the endpoint has ``*`` or ``::`` or is ipc/inproc, and
  *connects* otherwise (:func:`should_bind`).
* A ``ROUTER`` replay socket (always bound) answers ``[b"", start_seq]`` from a ``DEALER`` with
  ``[b"", topic, seq, payload]`` for every buffered batch whose seq >= start_seq, oldest first,
  then the end marker ``[b"", b"", 0xFF*8, b""]``. The buffer keeps the last ``buffer_steps``
  batches, so a start older than the buffer silently replays from later.

The payload is the engine's msgpack bytes, untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
"""The replay end marker's seq frame: -1 as a signed 8-byte big-endian integer."""


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: bind for wildcard hosts and ipc/inproc, connect for a concrete address."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class EventPublisher:
    """One replica's PUB socket, replay buffer and ROUTER replay socket."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10000,
        hwm: int = 100000,
    ) -> None:
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self.published = 0
        self.dropped = 0
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        try:
            if should_bind(endpoint):
                self._pub.bind(endpoint)
                self.endpoint = self._last_endpoint(self._pub)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._last_endpoint(self._replay)
        except zmq.ZMQError:
            self.close()
            raise

    @staticmethod
    def _last_endpoint(sock: zmq.asyncio.Socket) -> str:
        # The bound address with the real port (binding "tcp://127.0.0.1:*" picks a free one).
        # A "*" host is reported as 0.0.0.0; subscribers reach it on loopback.
        ep = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return ep.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://[::]:", "tcp://[::1]:")

    @property
    def next_seq(self) -> int:
        return self._seq

    def start(self) -> None:
        """Starts serving replay requests (call from the event loop)."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def publish(self, payload: bytes, *, drop: bool = False) -> int:
        """Buffers and sends one batch; returns its seq. With ``drop`` the seq is consumed and the
        batch buffered for replay, but nothing is sent (a gap for live subscribers)."""
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if drop:
            self.dropped += 1
        else:
            # PUB never blocks: at the high-water mark ZMQ drops the message, as vLLM's does.
            await self._pub.send_multipart((self._topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
            self.published += 1
        return seq

    def reset(self) -> None:
        """An engine restart: the sequence starts again at 0 and the replay buffer is empty."""
        self._seq = 0
        self._buffer.clear()

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            try:
                frames = await sock.recv_multipart()
            except zmq.ZMQError:  # the socket was closed
                return
            if len(frames) != 3:
                log.warning("invalid replay request: %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            try:
                # A snapshot: publishing may go on while we send.
                for seq, payload in list(self._buffer):
                    if seq >= start_seq:
                        await sock.send_multipart((client, b"", self._topic, seq_bytes(seq), payload))
                await sock.send_multipart((client, b"", b"", END_SEQ, b""))
            except zmq.ZMQError as e:  # the client went away
                log.debug("replay to a client failed: %s", e)

    async def aclose(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        self.close()

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
