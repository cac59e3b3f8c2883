"""One gRPC channel and one Master stub per master address, for one client.

Both SDKs keep them the same way (:class:`~kvstore.client.control.Control` with
blocking channels, :class:`~kvstore.client.aio.AsyncKVClient` with ``grpc.aio``
ones); only how a channel is made and closed differs.

Thread safety: :meth:`MasterStubs.get` and :meth:`MasterStubs.take_channels`
take one lock.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.rpc import ClientCredentials


class MasterStubs:
    """The Master stubs of one client, made on first use.

    Args:
        creds: the client's credentials.
        make_channel: ``(address, creds) -> channel`` (:func:`kvstore.rpc.channel` or
            :func:`kvstore.rpc.aio_channel`).
    """

    def __init__(self, creds: ClientCredentials, make_channel: Callable[..., Any]):
        self.creds, self._make = creds, make_channel
        self._lock = threading.Lock()
        self._channels: dict[str, Any] = {}
        self._stubs: dict[str, pb_grpc.MasterStub] = {}

    def get(self, address: str) -> pb_grpc.MasterStub:
        """The stub of the master at ``address`` (host:port)."""
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                ch = self._channels[address] = self._make(address, self.creds)
                stub = self._stubs[address] = pb_grpc.MasterStub(ch)
            return stub

    def take_channels(self) -> list:
        """Every channel made so far, for the caller to close; the next :meth:`get` makes anew."""
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
            self._stubs.clear()
        return channels
