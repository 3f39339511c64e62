"""Peer fan-out between ``kvroute serve`` replicas: reservations and their lifecycle over ZMQ.

:class:`PeerFanout` (:mod:`kvroute.peers.fanout`) sends and receives; :mod:`kvroute.peers.wire` is
the batch format; :mod:`kvroute.peers.links` the sockets to peers; :mod:`kvroute.peers.remote`
applies what peers send through the core's remote-reservation API.
"""

from kvroute.peers.fanout import PeerFanout
from kvroute.peers.links import CurveKeys
from kvroute.peers.remote import RemoteLedger

__all__ = ["CurveKeys", "PeerFanout", "RemoteLedger"]
