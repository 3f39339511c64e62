"""Peer fan-out units: the wire format, applying batches to a scheduler, settings.

The routers talking to each other over real sockets are in ``test_serve_peers.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from kvroute import PrefixIndex, Scheduler, block_hashes
from kvroute.config import ConfigError, PeerSpec, RouterConfig, parse_peer, read_peers_file
from kvroute.peers import RemoteLedger, wire

ME, PEER = 7, 99


def test_wire_round_trip() -> None:
    hashes = block_hashes(list(range(64)))
    records = [
        wire.reserve(5, "engine-ü", 1, 300, 320, 64, hashes),
        wire.prefill_done(5),
        wire.progress(5, 17),
        wire.finished(5),
    ]
    frame = wire.batch(wire.UPDATES, PEER, 3, 12.5, "r1", records)
    b = wire.decode(frame)
    assert (b.kind, b.origin, b.seq, b.sent_at, b.name) == (wire.UPDATES, PEER, 3, 12.5, "r1")
    assert b.records == [
        wire.Reserve(5, "engine-ü", 1, 300, 320, 64, hashes),
        wire.PrefillDone(5),
        wire.Progress(5, 17),
        wire.Finished(5),
    ]
    snap = wire.decode(wire.batch(wire.SNAPSHOT, PEER, 4, 0.0, "r1", [wire.held(5, "e", 0, 1, 2, True, 3)]))
    assert snap.records == [wire.Held(5, "e", 0, 1, 2, True, 3)]
    secret = b"s" * 16
    assert wire.verify(secret, frame, wire.sign(secret, frame))
    assert not wire.verify(secret, frame + b"x", wire.sign(secret, frame))


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"XXXX" + bytes(28),
        wire.batch(wire.UPDATES, 1, 1, 0.0, "r", [wire.reserve(1, "e", 0, 1, 1, 1, bytes(16))])[:-3],
        wire.batch(wire.UPDATES, 1, 1, 0.0, "r", [b"\x09" + bytes(8)]),
        wire.batch(wire.UPDATES, 1, 1, 0.0, "r", [wire.held(1, "e", 0, 1, 1, False, 0)]),
        wire.batch(wire.SNAPSHOT, 1, 1, 0.0, "r", [wire.finished(1)]),
        wire.batch(wire.UPDATES, 1, 1, 0.0, "r", [wire.finished(1)])[:-1],
    ],
)
def test_wire_rejects_malformed_batches(frame: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.decode(frame)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ledger(
    timeout_s: float = 10.0, index: PrefixIndex | None = None
) -> tuple[RemoteLedger, Scheduler, Clock]:
    sched = Scheduler(index or PrefixIndex(), router_id=ME)
    sched.upsert_worker(3, capacity_blocks=1000)
    backend = SimpleNamespace(engines=[SimpleNamespace(worker=3)])
    fleet: Any = SimpleNamespace(scheduler=sched, backends={"b": backend})
    clock = Clock()
    return RemoteLedger(fleet, timeout_s=timeout_s, clock=clock), sched, clock


def updates(seq: int, *records: bytes, origin: int = PEER) -> wire.Batch:
    return wire.decode(wire.batch(wire.UPDATES, origin, seq, 0.0, "peer", list(records)))


def snapshot(seq: int, *records: bytes) -> wire.Batch:
    return wire.decode(wire.batch(wire.SNAPSHOT, PEER, seq, 0.0, "peer", list(records)))


def load(sched: Scheduler) -> tuple[int, int, int, int, int]:
    lo = sched.loads()[3]
    return sched.reservations(), lo["prefill_tokens"], lo["kv_blocks"], lo["active"], lo["decoding"]


def test_remote_lifecycle_and_tombstones() -> None:
    index = PrefixIndex()
    rl, sched, _ = ledger(index=index)
    hashes = block_hashes(list(range(32)))
    assert rl.apply(updates(1, wire.reserve(1, "b", 0, 30, 32, 8, hashes))) == "applied"
    assert load(sched) == (1, 30, 2, 1, 0)
    assert index.find_matches(hashes) == {3: (2, 0)}  # speculated where the peer routed
    rl.apply(updates(2, wire.prefill_done(1), wire.progress(1, 32)))
    assert load(sched) == (1, 0, 4, 1, 1)
    rl.apply(updates(3, wire.finished(1)))
    assert load(sched) == (0, 0, 0, 0, 0)
    # A late (or repeated) reserve of the finished request cannot resurrect it.
    assert rl.apply(updates(4, wire.reserve(1, "b", 0, 30, 32, 8, b""), wire.prefill_done(1))) == "applied"
    assert load(sched) == (0, 0, 0, 0, 0)
    assert rl.apply(updates(4, wire.reserve(2, "b", 0, 30, 32, 8, b""))) == "duplicate"  # seq not new
    assert load(sched) == (0, 0, 0, 0, 0)
    sched.check_invariants()


def test_own_batches_and_unknown_engines_are_ignored() -> None:
    rl, sched, _ = ledger()
    assert rl.apply(updates(1, wire.reserve(1, "b", 0, 30, 32, 8, b""), origin=ME)) == "own"
    rl.apply(updates(1, wire.reserve(1, "nope", 0, 30, 32, 8, b""), wire.reserve(2, "b", 5, 1, 1, 1, b"")))
    assert load(sched) == (0, 0, 0, 0, 0)
    assert rl.results["own"] == 1
    assert rl.unknown_engines == 2


def test_snapshot_repairs_lost_messages() -> None:
    rl, sched, _ = ledger()
    rl.apply(updates(1, wire.reserve(1, "b", 0, 30, 32, 8, b""), wire.reserve(2, "b", 0, 10, 16, 8, b"")))
    # Lost: FINISHED of 1, RESERVE of 3, PREFILL of 2. The snapshot lists 2 (decoding) and 3.
    rl.apply(snapshot(5, wire.held(2, "b", 0, 10, 16, True, 20), wire.held(3, "b", 0, 50, 64, False, 0)))
    assert load(sched) == (2, 50, 1 + 1 + 4, 2, 1)
    assert rl.live_by_origin() == {f"peer/{PEER:x}": 2}
    rl.apply(snapshot(6))  # nothing held any more
    assert load(sched) == (0, 0, 0, 0, 0)


def test_silent_origins_are_dropped() -> None:
    rl, sched, clock = ledger(timeout_s=2.0)
    rl.apply(updates(1, wire.reserve(1, "b", 0, 30, 32, 8, b"")))
    clock.now = 1.5
    assert rl.expire() == []
    clock.now = 2.5
    assert rl.expire() == ["peer"]
    assert load(sched) == (0, 0, 0, 0, 0)
    assert rl.timeouts == 1
    assert rl.origins == {}


def test_handle_checks_signatures_and_age() -> None:
    from kvroute.peers import PeerFanout

    sched = Scheduler(PrefixIndex(), router_id=ME)
    fleet: Any = SimpleNamespace(scheduler=sched, backends={})
    config = RouterConfig(admin_key="k", peer_secret="x" * 16, peer_bind="tcp://127.0.0.1:*")
    fanout = PeerFanout(config, fleet, "me")
    frame = wire.batch(wire.UPDATES, PEER, 1, time.time(), "peer", [])
    secret = b"x" * 16
    assert fanout.handle([frame]) == "auth_failed"
    assert fanout.handle([frame, wire.sign(b"y" * 16, frame)]) == "auth_failed"
    assert fanout.handle([frame, wire.sign(secret, frame)]) == "applied"
    old = wire.batch(wire.UPDATES, PEER, 2, time.time() - 600, "peer", [])
    assert fanout.handle([old, wire.sign(secret, old)]) == "stale"
    bad = b"garbage"
    assert fanout.handle([bad, wire.sign(secret, bad)]) == "malformed"
    fanout.links.close()


def test_peer_settings(tmp_path: Path) -> None:
    pub, sec = (k.decode() for k in zmq.curve_keypair())
    assert parse_peer(f" tcp://10.0.0.2:5600;key={pub} ") == PeerSpec("tcp://10.0.0.2:5600", pub)
    for bad in ("10.0.0.2:5600", "tcp://host", "tcp://h:1;key=short", "tcp://h:1;k=v", "tcp://h:99999"):
        with pytest.raises(ConfigError):
            parse_peer(bad)
    f = tmp_path / "peers"
    f.write_text(f"# the fleet\n\ntcp://a:1\n  tcp://b:2;key={pub}\n")
    assert read_peers_file(f) == (PeerSpec("tcp://a:1"), PeerSpec("tcp://b:2", pub))
    base: dict[str, Any] = {"admin_key": "k"}
    c = RouterConfig(**base, peers=("tcp://a:1", "tcp://b:2"), peer_bind="tcp://0.0.0.0:5600")
    assert c.fanout
    assert c.peer_specs == (PeerSpec("tcp://a:1"), PeerSpec("tcp://b:2"))
    assert not RouterConfig(**base).fanout
    with pytest.raises(ConfigError, match="needs ;key"):
        RouterConfig(**base, peers=("tcp://a:1",), peer_curve_secret_key=sec)
    with pytest.raises(ConfigError, match="peer_curve_secret_key is unset"):
        RouterConfig(**base, peers=(f"tcp://a:1;key={pub}",))
    with pytest.raises(ConfigError, match="peer_secret"):
        RouterConfig(**base, peer_secret="short")
    with pytest.raises(ConfigError, match="peer_timeout_s"):
        RouterConfig(**base, peer_timeout_s=1.0, peer_snapshot_interval_s=2.0)
    with pytest.raises(ConfigError, match="peer_bind"):
        RouterConfig(**base, peer_bind="0.0.0.0:5600")
    env = RouterConfig.load(environ={"KVROUTE_PEERS": "tcp://a:1,tcp://b:2", "KVROUTE_ADMIN_KEY": "k"})
    assert len(env.peer_specs) == 2
    assert "pppp" not in repr(RouterConfig(**base, peer_secret="p" * 16))  # secrets stay out of logs
