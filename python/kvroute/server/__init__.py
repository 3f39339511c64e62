"""``kvroute serve``: the OpenAI-compatible routing front.

CLI (:mod:`kvroute.server.cli`) -> :class:`~kvroute.config.RouterConfig` ->
:class:`~kvroute.server.runner.RouterServer` (a Starlette app on uvicorn, a
:class:`~kvroute.fleet.Fleet` of backends, a :class:`~kvroute.prompts.PromptEncoder` and a
:class:`~kvroute.proxy.Proxy`).

:class:`RouterServer` and :func:`serve` are imported on first use, so ``kvroute`` commands that do
not serve do not pay for importing the HTTP stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute.server.runner import RouterServer, serve

__all__ = ["RouterServer", "serve"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvroute.server import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
