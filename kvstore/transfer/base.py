"""The client side of the data plane: one interface, several transports.

A transport moves value bytes between the caller's memory and one store
node. ``TcpTransport`` frames them over a socket; ``ShmTransport`` copies
through the node's shared-memory segment when client and node share a host
(RDMA joins behind the same interface). Batch forms pipeline their frames:
one round trip for many keys.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from kvstore.errors import KVStoreError
from kvstore.transfer import codec
from kvstore.types import TransportKind


@dataclass(slots=True)
class WriteItem:
    key: str
    object_id: int
    data: memoryview         # the value, 1-D bytes view
    checksum: int | None     # xxh3-64 of data; None: the transport computes it, and sets it
    parent: str = ""         # previous block of its prefix chain ("" for none): eviction hint
    replica_num: int = 0     # replicas the put asked for (0: not said); the frame's flags


@dataclass(slots=True)
class ReadItem:
    key: str
    object_id: int
    size_bytes: int
    checksum: int            # expected xxh3-64, checked after the copy when verify is on
    dest: memoryview         # writable, at least size_bytes long


def hash_unhashed(items: list[WriteItem]) -> None:
    """Compute the checksum of each item that has none yet (a transport that
    sends it ahead of the bytes)."""
    for it in items:
        if it.checksum is None:
            it.checksum = codec.value_hash(it.data)


class Transport(abc.ABC):
    """Moves values to and from one node. Not thread-safe: one per thread.

    Attributes:
        kind: how it moves the bytes (each subclass names its own).
    """

    kind: TransportKind

    @abc.abstractmethod
    def write_many(self, items: list[WriteItem]) -> list[KVStoreError | None]:
        """Write each value; per-item error or None, in input order. An item's
        ``checksum`` of None is computed here (where it pays, while copying)
        and set on the item, whatever the outcome."""

    @abc.abstractmethod
    def read_many(self, items: list[ReadItem], verify: bool = True) -> list[KVStoreError | None]:
        """Read each value into its ``dest``; per-item error or None, in input order."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the connection and any mapping."""
