"""The exception hierarchy: one base class, builtin bases where callers expect them."""

from __future__ import annotations

import pickle

import pytest

import kvroute
from kvroute import (
    InvalidArgumentError,
    InvalidEventError,
    KvrouteError,
    NoEligibleWorkerError,
    TooManyWorkersError,
    UnknownPolicyError,
    UnknownWorkerError,
)

HIERARCHY = [
    (KvrouteError, (Exception,)),
    (InvalidEventError, (KvrouteError, ValueError)),
    (InvalidArgumentError, (KvrouteError, ValueError)),
    (UnknownWorkerError, (KvrouteError, KeyError)),
    (NoEligibleWorkerError, (KvrouteError,)),
    (TooManyWorkersError, (KvrouteError,)),
    (UnknownPolicyError, (KvrouteError, ValueError)),
]


@pytest.mark.parametrize(("cls", "bases"), HIERARCHY, ids=lambda c: getattr(c, "__name__", ""))
def test_bases(cls: type[Exception], bases: tuple[type, ...]) -> None:
    assert cls.__bases__ == bases
    assert cls.__module__ == "kvroute._native"
    assert cls.__doc__
    assert getattr(kvroute._native, cls.__name__) is cls


@pytest.mark.parametrize("cls", [c for c, _ in HIERARCHY], ids=lambda c: c.__name__)
def test_pickle_round_trip(cls: type[Exception]) -> None:
    e = pickle.loads(pickle.dumps(cls("boom")))
    assert type(e) is cls
    assert e.args == ("boom",)


def test_bad_input_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"msgpack|KV event batch"):
        kvroute.PrefixIndex().apply(0, b"\xc1")
    with pytest.raises(ValueError, match="whole uint32 words"):
        kvroute.block_hashes(b"abc")


def test_too_many_workers() -> None:
    index = kvroute.PrefixIndex()
    for w in range(kvroute.MAX_WORKERS):
        index.add_worker(w)
    with pytest.raises(TooManyWorkersError):
        index.add_worker(kvroute.MAX_WORKERS)
    index.add_worker(0)  # idempotent for a known worker
    assert index.remove_worker(7) == 0
    index.add_worker(kvroute.MAX_WORKERS)  # the freed slot is reused
    assert len(index.workers()) == kvroute.MAX_WORKERS


def test_check_invariants_passes_on_a_fresh_index() -> None:
    kvroute.PrefixIndex().check_invariants()
