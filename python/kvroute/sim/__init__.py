"""A simulated vLLM fleet: vLLM's HTTP API and KV-event wire format over kvroute's engine model.

``kvroute sim --replicas N --base-port P`` runs it from the command line; tests and the router's
``--sim N`` mode embed it with :class:`SimCluster`. See :mod:`kvroute.sim.config` for the port
convention and :mod:`kvroute.sim.faults` for fault injection.

:class:`SimCluster` is imported on first use, so ``kvroute`` commands that do not simulate do not
pay for importing the HTTP server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvroute.sim.config import ConfigError, EngineConfig, SimConfig
from kvroute.sim.faults import FaultError, FaultSpec

if TYPE_CHECKING:
    from kvroute.sim.cluster import SimCluster

__all__ = ["ConfigError", "EngineConfig", "FaultError", "FaultSpec", "SimCluster", "SimConfig"]


def __getattr__(name: str) -> Any:
    if name == "SimCluster":
        from kvroute.sim.cluster import SimCluster

        return SimCluster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
