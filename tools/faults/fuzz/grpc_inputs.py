"""Master inputs: real protobuf requests with mutated fields, mutated encodings, raw bytes.

An input is one unary call: a method path, the credentials it carries (a
role's token, a made-up one, a malformed header, none) and the request's
bytes; the driver sends the bytes as they are (no client-side
serialization), so valid and broken encodings travel the same way. Cases
(``GrpcInput.kind``)::

    valid:<Method>     the method's request built from the real message types, its
                       fields mutated: empty / huge / unicode / control-char keys,
                       sizes 0 .. 2^64-1, replica_num 0 .. 2^32-1, bogus node ids and
                       incarnations (a small pool, so later calls may match earlier
                       registrations), out-of-range enum values, many items
                       (MAX_KEYS_PER_CALL and one more)
    encoding:<Method>  a valid request's bytes with one structure-blind mutation
    raw:<Method>       random bytes to the method
    unknown_method     a path the server does not serve

Node ids never name the cluster's own node in RegisterNode: a registration
under its id while it is alive is refused (that is checked with Heartbeat
and ReportEvents), and keeping the rest of the cluster working is what lets
the checker's reads mean something.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvstore._proto import kvstore_pb2 as pb
from kvstore.rpc import MAX_KEYS_PER_CALL
from kvstore.tools.faults.fuzz.mutate import (POOL_KEYS, fuzz_key, fuzz_text, mutate_bytes,
                                              random_bytes, small_or_boundary)

SERVICE = "/kvstore.v1.Master/"
METHODS = ("RegisterNode", "SyncInventory", "Heartbeat", "ReportEvents", "GetShardMap",
           "GrantPlacement", "Lookup", "Exists", "Remove", "List", "Stat", "ReportFailure")
_NODE_METHODS = frozenset({"RegisterNode", "SyncInventory", "Heartbeat", "ReportEvents"})
#: The credentials an input carries; the driver maps role names to the run's tokens.
CREDENTIALS = (("client", 40), ("node", 25), ("admin", 15), ("none", 10), ("bogus", 6),
               ("malformed", 4))
_FAKE_NODES = tuple(f"fuzz-node-{i}" for i in range(8))
_INCARNATIONS = tuple(f"fuzz-incarnation-{i}" for i in range(4))


@dataclass(frozen=True, slots=True)
class GrpcInput:
    kind: str
    method: str         # full path, /package.Service/Method
    credentials: str    # a role name, "none", "bogus:<token>" or "malformed:<header value>"
    body: bytes

    def fingerprint(self) -> bytes:
        return b"\0".join((self.kind.encode(), self.method.encode(),
                           self.credentials.encode("utf-8", "surrogatepass"), self.body))


def _u32(rng: random.Random) -> int:
    return min(small_or_boundary(rng, 4, 2**32 - 1), 2**32 - 1)     # the field holds no more


def _u64(rng: random.Random) -> int:
    return small_or_boundary(rng, 1 << 20)


def _key(rng: random.Random) -> str:
    key = fuzz_key(rng)
    # A lone surrogate cannot be put in a protobuf string: make it the replacement char.
    return key.encode("utf-8", "replace").decode("utf-8")


class GrpcGenerator:
    """Deterministic master inputs (see the module docstring).

    Args:
        rng: the surface's own random source.
        node_id: the cluster's real node (used only where a live id must be refused).
    """

    def __init__(self, rng: random.Random, node_id: str = "n0"):
        self.rng = rng
        self.node_id = node_id
        self._creds = [c for c, _ in CREDENTIALS]
        self._cred_weights = [w for _, w in CREDENTIALS]

    def next(self) -> GrpcInput:
        rng = self.rng
        method = rng.choice(METHODS)
        creds = self._credentials(method)
        pick = rng.random()
        if pick < 0.75:
            return GrpcInput(f"valid:{method}", SERVICE + method, creds, self.request(method))
        if pick < 0.92:
            _how, body = mutate_bytes(rng, self.request(method))
            return GrpcInput(f"encoding:{method}", SERVICE + method, creds, body)
        if pick < 0.98:
            return GrpcInput(f"raw:{method}", SERVICE + method, creds, random_bytes(rng, 256))
        path = rng.choice(("/kvstore.v1.Master/Nope", "/kvstore.v1.Nope/Lookup", "/",
                           "/grpc.health.v1.Health/Check", "/kvstore.v1.Master/lookup"))
        return GrpcInput("unknown_method", path, creds, random_bytes(rng, 64))

    def _credentials(self, method: str) -> str:
        rng = self.rng
        creds = rng.choices(self._creds, self._cred_weights)[0]
        if method in _NODE_METHODS and creds == "client" and rng.random() < 0.8:
            creds = "node"          # mostly the role that may call it: get past the check
        if creds == "bogus":
            # Printable ASCII only: anything else is refused by grpc before it is sent.
            text = "".join(c for c in fuzz_text(rng, 40) if " " <= c <= "~")
            return "bogus:" + rng.choice(("x" * 16, "client-" + "0" * 32, text or "t"))
        if creds == "malformed":
            return "malformed:" + rng.choice(("Bearer", "Bearer ", "Basic abc", "bearer  " + "a" * 20,
                                              "Bearer " + "A" * 4096, "Token x"))
        return creds

    # ---- requests ----
    def _items(self) -> int:
        """How many items a batch request carries: mostly few, sometimes the limit and over."""
        rng = self.rng
        return rng.choice((0, 1, 1, 2, 3, 8, 64)) if rng.random() < 0.98 else \
            rng.choice((MAX_KEYS_PER_CALL, MAX_KEYS_PER_CALL + 1))

    def _node_address(self) -> pb.NodeAddress:
        rng = self.rng
        return pb.NodeAddress(
            node_id=rng.choice((*_FAKE_NODES, "", fuzz_text(rng, 200), "n" * 129)),
            host=rng.choice(("127.0.0.1", "localhost", "", "h" * 300, "::1", fuzz_text(rng))),
            data_port=rng.choice((1, 9, 65535, 0, -1, 70000, 2**31 - 1, -2**31)),
            shm_name=rng.choice(("", "kvstore-fuzz", fuzz_text(rng, 300))),
            host_id=rng.choice(("", "fuzz-host", fuzz_text(rng))),
            tls=rng.random() < 0.1, metrics_address=rng.choice(("", "127.0.0.1:9", fuzz_text(rng))))

    def _tier_stat(self) -> pb.TierStat:
        rng = self.rng
        cap = _u64(rng)
        return pb.TierStat(tier=rng.choice((0, 1, 2, 3, 7, 2**31 - 1)), capacity_bytes=cap,
                           used_bytes=_u64(rng), free_bytes=_u64(rng), num_objects=_u64(rng),
                           high_watermark=rng.choice((0.95, 0.0, 1.0, -1.0, 2.0, float("nan"),
                                                      float("inf"))),
                           low_watermark=rng.choice((0.85, 0.0, float("-inf"))),
                           eviction_blocked=rng.choice(("", fuzz_text(rng))))

    def _incarnation(self) -> str:
        rng = self.rng
        return rng.choice((*_INCARNATIONS, "", fuzz_text(rng)))

    def _beat_node(self) -> str:
        return self.rng.choice((*_FAKE_NODES, self.node_id, "", fuzz_text(self.rng)))

    def request(self, method: str) -> bytes:
        """A valid encoding of ``method``'s request, its fields mutated (deterministic:
        map fields are written in key order, not in the process's hash order)."""
        return getattr(self, f"_r_{method}")().SerializeToString(deterministic=True)

    def _r_RegisterNode(self):
        rng = self.rng
        return pb.RegisterNodeRequest(
            address=self._node_address(), tier=rng.choice((0, 2, 5)), capacity_bytes=_u64(rng),
            max_object_bytes=_u64(rng), tiers=[self._tier_stat() for _ in range(rng.randint(0, 3))],
            incarnation=self._incarnation())

    def _r_SyncInventory(self):
        rng = self.rng
        items = [pb.InventoryItem(key=key, object_id=_u64(rng), size_bytes=_u64(rng),
                                  checksum=rng.getrandbits(64), tier=rng.choice((0, 2, 3, 9)),
                                  pending=rng.random() < 0.3, replica_num=_u32(rng))
                 for key in self._keys(self._items() if rng.random() < 0.3 else 0)]
        return pb.SyncInventoryRequest(
            node_id=self._node_address().node_id, incarnation=self._incarnation(),
            sync_id=_u64(rng), seq=_u32(rng), items=items, last=rng.random() < 0.5)

    def _r_Heartbeat(self):
        rng = self.rng
        copied = [pb.CopyResult(key=_key(rng), object_id=_u64(rng), target_node_id=self._beat_node(),
                                status=pb.Status(code=rng.choice((0, 1, 9, 99)),
                                                 message=fuzz_text(rng)))
                  for _ in range(rng.choice((0, 0, 1, 5)))]
        counters = {fuzz_text(rng, 20): _u64(rng) for _ in range(rng.choice((0, 0, 2)))}
        return pb.HeartbeatRequest(
            node_id=self._beat_node(), used_bytes=_u64(rng), num_objects=_u64(rng),
            tiers=[self._tier_stat() for _ in range(rng.randint(0, 2))], counters=counters,
            copied=copied, incarnation=self._incarnation(), leaving=rng.random() < 0.1)

    def _r_ReportEvents(self):
        rng = self.rng
        events = [pb.ReplicaEvent(kind=rng.choice((0, 1, 2, 3, 4, 4, 77)), key=key,
                                  object_id=_u64(rng), tier=rng.choice((0, 1, 2, 3, 8)),
                                  size_bytes=_u64(rng), checksum=rng.getrandbits(64))
                  for key in self._keys(self._items() if rng.random() < 0.5
                                        else rng.randint(0, 4))]
        return pb.ReportEventsRequest(node_id=self._beat_node(), events=events,
                                      incarnation=self._incarnation())

    def _r_GetShardMap(self):
        return pb.GetShardMapRequest()

    def _r_GrantPlacement(self):
        rng = self.rng
        return pb.GrantPlacementRequest(replica_num=_u32(rng), num_ids=_u32(rng),
                                        key=_key(rng) if rng.random() < 0.7 else "")

    def _keys(self, n: int | None = None) -> list[str]:
        """Keys of a batch request: each mutated, or (many items) plain ones with one
        mutated key in a hundred: the count is the point there, and 10,000 keys of
        up to 64 KiB each would test the message size limit instead."""
        rng = self.rng
        n = self._items() if n is None else n
        if n > 64:
            return [_key(rng) if i % 100 == 0 else f"fuzz/many/{rng.getrandbits(32):08x}"
                    for i in range(n)]
        return [_key(rng) for _ in range(n)]

    def _r_Lookup(self):
        return pb.LookupRequest(keys=self._keys())

    def _r_Exists(self):
        return pb.ExistsRequest(keys=self._keys())

    def _r_Remove(self):
        rng = self.rng
        keys = [k for k in self._keys() if k not in POOL_KEYS or rng.random() < 0.5]
        return pb.RemoveRequest(keys=keys, reason=rng.choice(("", "remove", "evict", "EVICT",
                                                              fuzz_text(rng))))

    def _r_List(self):
        rng = self.rng
        return pb.ListRequest(prefix=rng.choice(("", "fuzz", "fuzz-pool/", _key(rng))),
                              start_after=rng.choice(("", "fuzz-pool/3", _key(rng))),
                              limit=rng.choice((0, 1, 10, 1000, 2**32 - 1)))

    def _r_Stat(self):
        return pb.StatRequest()

    def _r_ReportFailure(self):
        rng = self.rng
        ids = [rng.choice((*_FAKE_NODES, fuzz_text(rng))) for _ in range(self._items() if
                                                                         rng.random() < 0.2 else 1)]
        return pb.ReportFailureRequest(node_ids=ids, reason=fuzz_text(rng))

