"""The gRPC settings of every kvstore server and channel, in one table.

    SERVER_OPTIONS    every grpc.aio server (masters, engines, conductor)
    CHANNEL_OPTIONS   every channel to them (SDK, store nodes, conductor, tools)

Messages may carry up to :data:`MAX_MESSAGE_BYTES` (a Lookup of thousands
of keys, a node's inventory). Servers bind exclusively: gRPC sets
SO_REUSEPORT by default, and a second server on a busy port would start
"fine" and split the clients between two processes. Channels reconnect to a
restarted peer within seconds (gRPC's default backoff grows to two minutes).
"""

from __future__ import annotations

import grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

_MESSAGE_SIZES = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]

SERVER_OPTIONS: list[tuple[str, int]] = _MESSAGE_SIZES + [("grpc.so_reuseport", 0)]

CHANNEL_OPTIONS: list[tuple[str, int]] = _MESSAGE_SIZES + [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def aio_server() -> grpc.aio.Server:
    """A grpc.aio server with kvstore's options (add ports and servicers, then start)."""
    return grpc.aio.server(options=SERVER_OPTIONS)


def listen(server: grpc.aio.Server, host: str, port: int) -> int:
    """Add a plaintext port to ``server``; returns the port bound (``port`` 0: a free one).

    Raises:
        OSError: the address cannot be bound (taken, or not an address of this host).
    """
    try:
        return server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:        # grpc's way of saying the address is taken
        raise OSError(f"cannot listen on {host}:{port}: {exc}") from None


def channel(address: str) -> grpc.Channel:
    """A blocking channel to ``address`` (host:port)."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def aio_channel(address: str) -> grpc.aio.Channel:
    """An asyncio channel to ``address`` (host:port)."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
