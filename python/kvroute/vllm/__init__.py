"""kvroute's engine-side plugin for vLLM: the receiving end of the token handoff.

Load it into each vLLM server the router hands prompts to::

    vllm serve MODEL --middleware kvroute.vllm.TokenHandoffMiddleware

The router tokenizes every request anyway (to route it); with the handoff it sends the ids over
ZMQ (``[key, little-endian u32 ids]``) to the chosen engine's channel and names the key in an
``X-Kvroute-Token-Key`` header, and this middleware turns the request into one vLLM 0.33 prefills
without templating or tokenizing. Anything missing or wrong falls back to the request as the client
sent it. ``kvroute sim`` serves every replica through the same middleware.

Settings (environment, read when vLLM builds its app): ``KVROUTE_HANDOFF=0`` (off),
``KVROUTE_HANDOFF_BIND`` (default ``tcp://*:*``: a free port on every interface),
``KVROUTE_HANDOFF_ADVERTISE``, ``_TTL_S`` (10), ``_MAX_ENTRIES`` (4096), ``_MAX_BYTES`` (256 MiB),
``_WAIT_S`` (0.05), ``_MAX_BODY_BYTES`` (64 MiB), ``_RCVHWM`` (1000).

Importing this package costs only the standard library (and kvroute's own small package init);
``zmq`` is imported when the receiver starts. Constructing the middleware more than once in a
process is harmless: instances with the same settings share one receiver.
"""

from kvroute.vllm.middleware import (
    COUNT_HEADER,
    INFO_PATH,
    KEY_HEADER,
    OUTCOME_HEADER,
    TokenHandoffMiddleware,
    shared_receiver,
)
from kvroute.vllm.receiver import PROTOCOL, HandoffSettings, TokenReceiver
from kvroute.vllm.store import StoreStats, TokenStore

__all__ = [
    "COUNT_HEADER",
    "INFO_PATH",
    "KEY_HEADER",
    "OUTCOME_HEADER",
    "PROTOCOL",
    "HandoffSettings",
    "StoreStats",
    "TokenHandoffMiddleware",
    "TokenReceiver",
    "TokenStore",
    "shared_receiver",
]
