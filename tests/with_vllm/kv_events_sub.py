"""A KV-event subscriber as a router runs one, for the connector's events test.

    python kv_events_sub.py ENDPOINT REPLAY_ENDPOINT OUT_JSON STOP_FILE

Subscribes (ZMQ SUB) to vLLM's publisher at ENDPOINT and decodes each
``[topic, seq (8-byte big-endian), msgpack KVEventBatch]`` with vLLM's own
msgspec classes until STOP_FILE exists; then asks the ROUTER at
REPLAY_ENDPOINT for every batch from seq 0 and decodes those too. Writes both
lists (``live``, ``replayed``: one entry per event, with its batch's seq) to
OUT_JSON. Runs with the vLLM environment's interpreter.
"""

import json
import sys
import time
from pathlib import Path

import msgspec
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _hex(h):
    return h.hex() if isinstance(h, bytes) else h


def _rows(seq: int, batch: KVEventBatch) -> list[dict]:
    rows = []
    for ev in batch.events:
        row = {"seq": seq, "type": type(ev).__name__}
        if isinstance(ev, (BlockStored, BlockRemoved)):
            row.update(hashes=[_hex(h) for h in ev.block_hashes], medium=ev.medium)
        if isinstance(ev, BlockStored):
            row.update(parent=_hex(ev.parent_block_hash), tokens=list(ev.token_ids),
                       block_size=ev.block_size)
        rows.append(row)
    return rows


def main() -> None:
    endpoint, replay, out, stop = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    live: list[dict] = []
    seqs: list[int] = []
    out.with_suffix(".up").write_text("up")
    deadline = time.monotonic() + 600
    while not stop.exists() and time.monotonic() < deadline:
        if sub.poll(100):
            _topic, seq_bytes, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            seqs.append(seq)
            live += _rows(seq, decoder.decode(payload))
            out.with_suffix(".live").write_text(json.dumps(live))
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replayed: list[dict] = []
    while dealer.poll(10_000):
        _empty, _topic, seq_bytes, payload = dealer.recv_multipart()
        if seq_bytes == END_SEQ:
            break
        replayed += _rows(int.from_bytes(seq_bytes, "big"), decoder.decode(payload))
    out.write_text(json.dumps({"live": live, "replayed": replayed, "seqs": seqs}))
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
