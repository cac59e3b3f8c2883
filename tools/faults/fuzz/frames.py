"""Data-port inputs: valid frames of every op, then mutated ones, plus raw bytes.

An input is the bytes one client writes on a data connection (TCP or the
Unix socket), and whether that connection completed the AUTH handshake with
a client token first (``authed``; the handshake itself is the driver's, since
its nonce comes from the node). Cases (``DataInput.kind``)::

    valid:<op>      one well-formed frame of that op (PUT with its value; keys from
                    the pool of real objects or fresh; right or wrong checksums)
    burst           8-48 valid frames back to back (a pipelined batch)
    out_of_order    SHM_COMMIT / RELEASE / ABORT with nothing to commit or release,
                    double ALLOC, ACQUIRE then two RELEASEs, DROP without an id
    auth_misuse     AUTH_HELLO mid-session, AUTH_PROVE with a made-up proof or too long
    boundary        a valid frame with size / object_id / checksum at an edge (0, max,
                    max+1, 2^64-1); a PUT whose size cannot be sent ends mid-value
    lying_lengths   key_len / parent_len / size larger or smaller than what follows
    truncated       a valid frame (or burst) cut short: the connection ends mid-frame
    mid_value       a PUT whose value stops part way (abrupt close)
    bitflip         a valid frame or burst with bits flipped anywhere
    mutated         one structure-blind mutation (insert, delete, duplicate, ...)
    unknown_op      op codes no handler serves, RDMA_CONNECT without RDMA
    random          1-512 random bytes

What the node will make of an input is computed by :mod:`.framing`, so the
driver knows how many replies to read and whether the node closes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import xxhash

from kvstore.transfer.protocol import REQUEST, Op
from kvstore.transfer.rdma_wire import OP_RDMA_CONNECT
from kvstore.tools.faults.fuzz.mutate import (POOL_KEYS, U64_MAX, boundary_int, flip_bits, fuzz_key,
                                              fuzz_key_bytes, mutate_bytes, pick_case, random_bytes,
                                              small_or_boundary)

MAX_VALUE_BYTES = 4096          # values the generator sends in full
_NAMES_LIMIT = 8192             # the node's key + parent limit (store/session.py)


@dataclass(frozen=True, slots=True)
class DataInput:
    kind: str          # the case that made it (see the module docstring)
    authed: bool       # sent on a connection that completed the handshake
    data: bytes

    def fingerprint(self) -> bytes:
        """A canonical encoding (generator determinism is checked on these)."""
        return self.kind.encode() + bytes([self.authed]) + len(self.data).to_bytes(8, "little") \
            + self.data


def frame(op: int, key: bytes = b"", parent: bytes = b"", object_id: int = 0, size: int = 0,
          checksum: int = 0, value: bytes = b"", flags: int = 0,
          key_len: int | None = None, parent_len: int | None = None) -> bytes:
    """One request frame; ``key_len``/``parent_len`` may lie about the bytes that follow."""
    kl = len(key) if key_len is None else key_len
    pl = len(parent) if parent_len is None else parent_len
    return REQUEST.pack(op & 0xFF, flags & 0xFF, kl & 0xFFFF, pl & 0xFFFFFFFF,
                        object_id & U64_MAX, size & U64_MAX, checksum & U64_MAX) \
        + key + parent + value


def _object_id(rng: random.Random) -> int:
    return rng.choice((0, 0, rng.randint(1, 64), rng.getrandbits(64), boundary_int(rng)))


def _key(rng: random.Random) -> bytes:
    key = fuzz_key_bytes(rng)
    return key[:rng.choice((64, 512, 600))] if len(key) > 512 and rng.random() < 0.7 else key[:65535]


class FrameGenerator:
    """Deterministic data-port inputs (see the module docstring).

    Args:
        rng: the surface's own random source (seeded by the runner).
        p_anonymous: share of inputs sent on a connection that did not authenticate.
    """

    CASES = (("valid", 30), ("burst", 10), ("out_of_order", 8), ("auth_misuse", 3),
             ("boundary", 8), ("lying_lengths", 6), ("truncated", 4), ("mid_value", 3),
             ("bitflip", 12), ("mutated", 8), ("unknown_op", 3), ("random", 5))

    def __init__(self, rng: random.Random, p_anonymous: float = 0.1):
        self.rng = rng
        self.p_anonymous = p_anonymous

    def next(self) -> DataInput:
        rng = self.rng
        authed = rng.random() >= self.p_anonymous
        case = pick_case(rng, self.CASES)
        kind, data = getattr(self, f"_{case}")()
        return DataInput(kind, authed, data)

    # ---- valid frames ----
    def valid_frame(self, op: Op | None = None) -> tuple[str, bytes]:
        rng = self.rng
        op = op or rng.choice(list(Op))
        key = rng.choice(POOL_KEYS).encode() if rng.random() < 0.5 else _key(rng)[:200]
        oid = _object_id(rng)
        if op is Op.PUT or op is Op.SHM_ALLOC:
            value = random_bytes(rng, MAX_VALUE_BYTES)
            good = xxhash.xxh3_64_intdigest(value)
            checksum = good if rng.random() < 0.6 else rng.getrandbits(64)
            parent = rng.choice((b"", rng.choice(POOL_KEYS).encode()))
            size = len(value) if op is Op.PUT else rng.randint(0, 1 << 20)
            return f"valid:{op.name}", frame(op, key, parent, oid or rng.randint(1, 2**40),
                                            size, checksum, value if op is Op.PUT else b"")
        size = {Op.PIN: rng.choice((0, 0, 1000, 60_000)), Op.UNPIN: rng.choice((0, 1)),
                Op.PREFETCH: rng.choice((100, 1000, 10_000))}.get(op, 0)
        if op is Op.STATS or op is Op.PING:
            key = b""
        if op is Op.AUTH_HELLO:
            return "valid:AUTH_HELLO", frame(op)
        if op is Op.AUTH_PROVE:     # a proof we cannot know: the node refuses and closes
            return "valid:AUTH_PROVE", frame(op, size=32, value=rng.randbytes(32))
        return f"valid:{op.name}", frame(op, key, object_id=oid, size=size,
                                         checksum=rng.getrandbits(64) if rng.random() < 0.2 else 0)

    def _valid(self) -> tuple[str, bytes]:
        op = self.rng.choice([op for op in Op if op is not Op.AUTH_PROVE])
        return self.valid_frame(op)

    def _burst_bytes(self, n: int) -> bytes:
        ops = [op for op in Op if op not in (Op.AUTH_PROVE, Op.AUTH_HELLO)]
        return b"".join(self.valid_frame(self.rng.choice(ops))[1] for _ in range(n))

    def _burst(self) -> tuple[str, bytes]:
        return "burst", self._burst_bytes(self.rng.randint(8, 48))

    def _out_of_order(self) -> tuple[str, bytes]:
        rng = self.rng
        key = rng.choice(POOL_KEYS).encode() if rng.random() < 0.5 else _key(rng)[:100]
        oid = rng.randint(1, 2**40)
        seqs = {
            "commit_without_alloc": [frame(Op.SHM_COMMIT, key, object_id=oid)],
            "release_without_acquire": [frame(Op.SHM_RELEASE, key, object_id=oid)],
            "abort_unknown": [frame(Op.SHM_ABORT, key, object_id=oid)],
            "double_alloc": [frame(Op.SHM_ALLOC, key, object_id=oid, size=64)] * 2
            + [frame(Op.SHM_ABORT, key, object_id=oid)],
            "alloc_commit_unwritten": [frame(Op.SHM_ALLOC, key, object_id=oid,
                                             size=rng.choice((0, 16, 4096)),
                                             checksum=rng.getrandbits(64)),
                                       frame(Op.SHM_COMMIT, key, object_id=oid)],
            "acquire_release_twice": [frame(Op.SHM_ACQUIRE, rng.choice(POOL_KEYS).encode())]
            + [frame(Op.SHM_RELEASE, rng.choice(POOL_KEYS).encode(), object_id=oid)] * 2,
            "drop_without_id": [frame(Op.DROP, key)],
            "unpin_unpinned": [frame(Op.UNPIN, key, size=rng.choice((0, 1, 2, U64_MAX)))],
        }
        name = rng.choice(sorted(seqs))
        return f"out_of_order:{name}", b"".join(seqs[name])

    def _auth_misuse(self) -> tuple[str, bytes]:
        rng = self.rng
        how = rng.choice(("hello_again", "prove_guess", "prove_long", "prove_empty"))
        if how == "hello_again":
            return "auth_misuse:hello_again", frame(Op.AUTH_HELLO) + self._burst_bytes(2)
        size = {"prove_guess": 32, "prove_long": rng.choice((65, 4096, U64_MAX)),
                "prove_empty": 0}[how]
        return f"auth_misuse:{how}", frame(Op.AUTH_HELLO) + frame(
            Op.AUTH_PROVE, size=size, value=rng.randbytes(min(size, 64)))

    # ---- edges and lies ----
    def _boundary(self) -> tuple[str, bytes]:
        rng = self.rng
        op = rng.choice(list(Op))
        field = rng.choice(("size", "object_id", "checksum"))
        value = boundary_int(rng)
        key = rng.choice(POOL_KEYS).encode()
        kw = {"object_id": rng.randint(1, 64), "size": 0, "checksum": 0, field: value}
        body = b""
        if op is Op.PUT and field == "size" and kw["size"] <= MAX_VALUE_BYTES:
            body = rng.randbytes(kw["size"])
        return f"boundary:{op.name}.{field}", frame(op, key, value=body, **kw)

    def _lying_lengths(self) -> tuple[str, bytes]:
        rng = self.rng
        key = rng.choice(POOL_KEYS).encode()
        op = rng.choice(list(Op))
        field = rng.choice(("key_len", "parent_len", "size"))
        lie = rng.choice((0, 1, len(key) - 1, len(key) + 1, 255, _NAMES_LIMIT,
                          _NAMES_LIMIT + 1, 65535, 2**32 - 1))
        kw = {"key_len": lie} if field == "key_len" else {"parent_len": lie} if \
            field == "parent_len" else {"size": small_or_boundary(rng, 64)}
        value = rng.randbytes(rng.randint(0, 64)) if op is Op.PUT or field == "size" else b""
        tail = self._burst_bytes(rng.randint(0, 3))
        return f"lying_lengths:{field}", frame(op, key, value=value, **kw) + tail

    def _truncated(self) -> tuple[str, bytes]:
        data = self._burst_bytes(self.rng.randint(1, 4))
        return "truncated", data[:self.rng.randrange(len(data))]

    def _mid_value(self) -> tuple[str, bytes]:
        rng = self.rng
        size = rng.choice((64, 4096, 1 << 20, 60 << 20))
        sent = rng.randint(0, min(size - 1, MAX_VALUE_BYTES))
        return "mid_value", frame(Op.PUT, rng.choice(POOL_KEYS).encode() + b"/w",
                                  object_id=rng.randint(1, 2**40), size=size,
                                  checksum=rng.getrandbits(64), value=rng.randbytes(sent))

    def _bitflip(self) -> tuple[str, bytes]:
        base = self._burst_bytes(self.rng.randint(1, 6))
        return "bitflip", flip_bits(self.rng, base, max_flips=4)

    def _mutated(self) -> tuple[str, bytes]:
        how, data = mutate_bytes(self.rng, self._burst_bytes(self.rng.randint(1, 6)))
        return f"mutated:{how}", data

    def _unknown_op(self) -> tuple[str, bytes]:
        rng = self.rng
        if rng.random() < 0.3:
            size = rng.choice((0, 16, 4096, 4097, U64_MAX))
            return "unknown_op:rdma_connect", frame(OP_RDMA_CONNECT, size=size,
                                                    value=rng.randbytes(min(size, 4096)))
        known = {int(op) for op in Op} | {OP_RDMA_CONNECT}
        op = rng.choice([o for o in range(256) if o not in known])
        return "unknown_op", frame(op, fuzz_key(rng).encode("utf-8", "replace")[:100],
                                   size=small_or_boundary(rng, 64))

    def _random(self) -> tuple[str, bytes]:
        return "random", random_bytes(self.rng, 512, 1)
