"""A reader that stops (run on a host of its own; tests/integration/test_stalled_reader.py).

    python netns_reader.py HOST:PORT KEY

Opens two data connections to the node: on the first, a GET of KEY whose
first MiB it reads before it stops reading; on the second, one PING, then
nothing. Prints ``ready`` and waits to be killed (or cut off).
"""

from __future__ import annotations

import socket
import sys
import time

from kvstore.transfer.protocol import REQUEST, RESPONSE, Op


def main(address: str, key: str) -> None:
    host, port = address.rsplit(":", 1)
    stalled = socket.create_connection((host, int(port)), timeout=30)
    stalled.sendall(REQUEST.pack(Op.GET, 0, len(key), 0, 0, 0, 0) + key.encode())
    want, got = RESPONSE.size + (1 << 20), 0
    while got < want:
        chunk = stalled.recv(min(want - got, 1 << 16))
        if not chunk:
            raise SystemExit("the node closed the GET early")
        got += len(chunk)
    idle = socket.create_connection((host, int(port)), timeout=30)
    idle.sendall(REQUEST.pack(Op.PING, 0, 0, 0, 0, 0, 0))
    assert len(idle.recv(RESPONSE.size, socket.MSG_WAITALL)) == RESPONSE.size
    print("ready", flush=True)
    while True:
        time.sleep(60)              # parked here, the connections open, until killed


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
