"""Helpers of the router tests: bounded async tests."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec

P = ParamSpec("P")


def async_test(
    timeout: float = 30.0,
) -> Callable[[Callable[P, Coroutine[Any, Any, None]]], Callable[P, None]]:
    """Runs an ``async def`` test in a fresh event loop, failing it after ``timeout`` seconds."""

    def wrap(fn: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> None:
            asyncio.run(asyncio.wait_for(fn(*args, **kwargs), timeout))

        return run

    return wrap
