"""The string verbs: GET, SET, MGET, MSET, SETNX, EXISTS, DEL, STRLEN, GETRANGE, ...

Each maps onto the SDK (:class:`~kvstore.client.KVClient`) with kvstore's
semantics, which docs/redis.md writes down:

- objects are immutable: SET of a stored key with equal bytes is ``OK``
  (the SDK's put answers False), with different bytes the KeyConflict error
  reply; NX answers nil for any stored key, XX nil for a missing one;
- a missing key is nil, a stored empty value an empty bulk string;
- there is no expiry: EX / PX / EXAT / PXAT are refused with an error,
  KEEPTTL is accepted (there is no TTL to lose), TTL is -1 for a stored key
  and -2 for a missing one;
- keys are UTF-8 text of 1 to 512 bytes without control characters (the
  SDK's rule); others are answered ``-ERR InvalidArgument``.

Thread safety: verbs run on their connection's thread; the SDK client is shared.
"""

from __future__ import annotations

from kvstore.errors import InvalidArgument, KeyConflict, KVStoreError, NotFound
from kvstore.client.integrations.resp.protocol import OK, RespError, Status
from kvstore.client.integrations.resp.table import command, dispatch, integer, key_of, store_error

_NO_EXPIRY = ("kvstore has no expiry: objects live until DEL or eviction, "
              "so SET {opt} is refused (see docs/redis.md)")


class ReplyBuffers:
    """One connection's buffers that GET values are read into, reused once the
    replies holding them are sent (:meth:`recycle`): no new buffer, and no
    fresh pages, per GET.

    Buffers are ``size_bytes`` long: the largest value this connection has
    read, up to :data:`MAX_BUFFER_BYTES`; larger values get buffers of their
    own. At most :attr:`capacity` are kept: ``POOL_BYTES // size_bytes``
    (32 of 256 KiB, 8 of 1 MiB, 1 of 8 MiB), so a connection's pool holds
    ``POOL_BYTES`` at most.

    Thread safety: one connection's thread.
    """

    POOL_BYTES = 8 << 20
    MAX_BUFFER_BYTES = 8 << 20
    MAX_POOLED = 32

    def __init__(self):
        self.size_bytes = 0
        self._free: list[bytearray] = []
        self._lent: list[bytearray] = []

    @property
    def capacity(self) -> int:
        """How many buffers the pool keeps (and a pooled read may take)."""
        return min(self.MAX_POOLED, self.POOL_BYTES // max(1, self.size_bytes))

    def learn(self, size_bytes: int) -> None:
        """A value of ``size_bytes`` was read: pool buffers that can hold it (if small enough)."""
        if self.size_bytes < size_bytes <= self.MAX_BUFFER_BYTES:
            self.size_bytes = size_bytes
            self._free.clear()

    def take(self) -> bytearray:
        buf = self._free.pop() if self._free else bytearray(self.size_bytes)
        self._lent.append(buf)
        return buf

    def recycle(self) -> None:
        """The replies are sent: lent buffers may be read into again."""
        keep = self.capacity - len(self._free)
        self._free += [b for b in self._lent[:keep] if len(b) == self.size_bytes]
        self._lent.clear()


def get_many(front, keys: list[str], buffers: ReplyBuffers | None = None) -> list:
    """Values (bytes-like) or None per key; counts hits and misses.

    With ``buffers`` and at most its ``capacity`` keys, values up to its size are
    read into its buffers (valid until it is recycled); others into new ones.

    Raises:
        KVStoreError: a failure other than NotFound (the first).
    """
    if buffers is not None and buffers.size_bytes and len(keys) <= buffers.capacity:
        values = _get_pooled(front, keys, buffers)
    else:
        values = front.kv.batch_get(keys) if len(keys) > 1 else [_get_one(front, keys[0])]
        if buffers is not None:
            buffers.learn(max((len(v) for v in values if not isinstance(v, KVStoreError)),
                              default=0))
    out = []
    for v in values:
        if isinstance(v, NotFound):
            front.stats.misses += 1
            out.append(None)
        elif isinstance(v, KVStoreError):
            raise v
        else:
            front.stats.hits += 1
            out.append(v)
    return out


def _get_pooled(front, keys: list[str], buffers: ReplyBuffers) -> list:
    dests = [buffers.take() for _ in keys]
    if len(keys) == 1:                   # the SDK's fast path for a cached key
        try:
            sizes = [front.kv.get_into(keys[0], dests[0])]
        except KVStoreError as err:
            sizes = [err]
    else:
        sizes = front.kv.batch_get_into(keys, dests)
    values = [memoryview(d)[:n] if isinstance(n, int) else n for d, n in zip(dests, sizes)]
    larger = [i for i, v in enumerate(values) if isinstance(v, InvalidArgument)]
    if larger:                           # did not fit (or a bad key): read into new buffers
        for i, v in zip(larger, front.kv.batch_get([keys[i] for i in larger])):
            values[i] = v
            if not isinstance(v, KVStoreError):
                buffers.learn(len(v))
    return values


def _get_one(front, key: str):
    try:
        return front.kv.get(key)
    except NotFound as err:
        return err


def get_run(front, session, run: list[list]) -> list:
    """Replies to a run of pipelined ``GET key`` commands, read as one batch; any
    failure of the batch (a bad key, a store error) answers each command alone.
    A key repeated in the run is read once and its replies share the value (the
    object is immutable, so each GET would read the same bytes), as
    :func:`set_run` puts a repeated key once."""
    try:
        if session.role is None:
            raise RespError("not authenticated")
        keys = [key_of(session, args[1]) for args in run]
        distinct = list(dict.fromkeys(keys))        # in order
        values = dict(zip(distinct, get_many(front, distinct, session.buffers)))
        out = [values[k] for k in keys]
        # get_many counted each distinct key once; the repeats count too.
        repeat_hits = sum(v is not None for v in out) - sum(v is not None for v in values.values())
        front.stats.hits += repeat_hits
        front.stats.misses += len(keys) - len(distinct) - repeat_hits
    except (RespError, KVStoreError):
        return [dispatch(front, session, args) for args in run]
    front.stats.commands += len(run)
    return out


def set_run(front, session, run: list[list]) -> list:
    """Replies to a run of pipelined plain ``SET key value`` commands, stored with
    one batch put. A key repeated in the run is put once: a later SET of equal
    bytes gets the first one's reply, of other bytes KeyConflict, as if the
    commands had run one after the other."""
    if session.role is None:
        return [dispatch(front, session, args) for args in run]
    first: dict[str, int] = {}            # key -> index of its first SET in the run
    replies: list = [None] * len(run)
    for i, args in enumerate(run):
        try:
            key = key_of(session, args[1])
        except RespError as err:
            replies[i] = err
            continue
        first.setdefault(key, i)
    keys = list(first)
    results = front.kv.batch_put(keys, [memoryview(run[first[k]][2]) for k in keys])
    front.stats.sets += len(keys)
    front.stats.commands += len(run)
    for key, err in zip(keys, results):
        replies[first[key]] = OK if err is None else store_error(err)
    for i, args in enumerate(run):
        if replies[i] is not None:
            continue
        j = first[key_of(session, args[1])]
        same = len(args[2]) == len(run[j][2]) and bytes(run[j][2]) == bytes(args[2])
        if replies[j] is OK and not same:
            replies[i] = store_error(KeyConflict("key holds different bytes; objects are "
                                                 "immutable", key=key_of(session, args[1])))
        else:
            replies[i] = replies[j]
    return replies


@command("GET", 2, "readonly fast", (1, 1, 1), "the value of a key (nil: missing)", "string")
def get(front, session, args):
    return get_many(front, [key_of(session, args[1])], session.buffers)[0]


@command("MGET", -2, "readonly fast", (1, -1, 1), "the values of keys (nil for each missing)",
         "string")
def mget(front, session, args):
    return get_many(front, [key_of(session, a) for a in args[1:]], session.buffers)


def _put(front, key: str, value) -> bool:
    """Store; True if written now, False if equal bytes were stored already.

    Raises:
        KeyConflict: other bytes are stored; and the SDK's other put errors.
    """
    written = front.kv.put(key, memoryview(value))
    front.stats.sets += 1
    return written


@command("SET", -3, "write", (1, 1, 1),
         "store a value (equal bytes again: OK; other bytes: KeyConflict); NX, XX, KEEPTTL",
         "string")
def set_(front, session, args):
    key, value = key_of(session, args[1]), args[2]
    nx = xx = False
    for raw in args[3:]:
        opt = bytes(raw[:16]).upper()
        if opt == b"NX":
            nx = True
        elif opt == b"XX":
            xx = True
        elif opt == b"KEEPTTL":
            pass                              # no TTL exists to keep or lose
        elif opt in (b"EX", b"PX", b"EXAT", b"PXAT"):
            raise RespError(_NO_EXPIRY.format(opt=opt.decode()))
        elif opt == b"GET":
            raise RespError("SET ... GET is not supported (objects are immutable; use GET)")
        else:
            raise RespError("syntax error")
    if nx and xx:
        raise RespError("syntax error")
    if xx and not front.kv.exists(key):
        return None
    try:
        written = _put(front, key, value)
    except KeyConflict:
        if nx:
            return None
        raise
    return None if nx and not written else OK


@command("SETNX", 3, "write fast", (1, 1, 1), "store a value if the key is missing (1/0)",
         "string")
def setnx(front, session, args):
    try:
        return int(_put(front, key_of(session, args[1]), args[2]))
    except KeyConflict:
        return 0


@command("MSET", -3, "write", (1, -1, 2),
         "store several values (not atomic: an error names the first key that failed)", "string")
def mset(front, session, args):
    if len(args) % 2 == 0:
        raise RespError("wrong number of arguments for 'mset' command")
    keys = [key_of(session, k) for k in args[1::2]]
    results = front.kv.batch_put(keys, [memoryview(v) for v in args[2::2]])
    front.stats.sets += len(keys)
    for key, err in zip(keys, results):
        if err is not None:
            err.key = key
            raise err
    return OK


@command("EXISTS", -2, "readonly fast", (1, -1, 1), "how many of the keys exist (repeats count)")
def exists(front, session, args):
    return sum(front.kv.batch_exists([key_of(session, a) for a in args[1:]]))


def _remove(front, session, args):
    results = front.kv.batch_remove([key_of(session, a) for a in args[1:]])
    for r in results:
        if r is not None and not isinstance(r, NotFound):
            raise r
    return sum(r is None for r in results)


command("DEL", -2, "write", (1, -1, 1), "remove keys; how many existed")(_remove)
command("UNLINK", -2, "write fast", (1, -1, 1), "DEL (the store frees memory when no "
        "reader holds it)")(_remove)


def _size(front, key: str) -> int | None:
    """The stored value's size in bytes, None if missing (no access counted)."""
    try:
        return front.kv.inspect(key).size_bytes
    except NotFound:
        return None


@command("STRLEN", 2, "readonly fast", (1, 1, 1), "a value's length in bytes (0: missing)",
         "string")
def strlen(front, session, args):
    return _size(front, key_of(session, args[1])) or 0


@command("GETRANGE", 4, "readonly", (1, 1, 1), "bytes start..end of a value (inclusive, "
         "negative from the end)", "string")
def getrange(front, session, args):
    start, end = integer(args[2]), integer(args[3])
    (value,) = get_many(front, [key_of(session, args[1])])
    if value is None:
        return b""
    n = len(value)
    start = max(start + n, 0) if start < 0 else start
    end = end + n if end < 0 else min(end, n - 1)
    if start > end or start >= n:
        return b""
    return memoryview(value)[start:end + 1]


@command("TYPE", 2, "readonly fast", (1, 1, 1), "string, or none for a missing key")
def type_(front, session, args):
    return Status("string" if front.kv.exists(key_of(session, args[1])) else "none")


def _ttl(front, session, args):
    return -1 if front.kv.exists(key_of(session, args[1])) else -2


command("TTL", 2, "readonly fast", (1, 1, 1), "-1 (no expiry in kvstore) or -2 (missing)")(_ttl)
command("PTTL", 2, "readonly fast", (1, 1, 1), "as TTL")(_ttl)


@command("MEMORY", -2, "readonly", (2, 2, 1), "MEMORY USAGE key: value bytes plus key bytes "
         "(nil: missing)")
def memory(front, session, args):
    sub = bytes(args[1][:16]).upper()
    if sub != b"USAGE" or len(args) not in (3, 5):
        raise RespError("only MEMORY USAGE key [SAMPLES n] is supported")
    size = _size(front, key_of(session, args[2]))
    return None if size is None else size + len(bytes(args[2]))


@command("KVSTORE.PIN", -2, "write", (1, 1, 1), "pin a key on its nodes: no ttl_ms (or 0) "
         "hard, ttl_ms > 0 soft for that long", "kvstore")
def pin(front, session, args):
    if len(args) > 3:
        raise RespError("wrong number of arguments for 'kvstore.pin' command")
    ttl_ms = integer(args[2], "ttl_ms") if len(args) == 3 else 0
    if ttl_ms < 0:
        raise RespError("ttl_ms must be >= 0")
    front.kv.pin(key_of(session, args[1]), ttl_ms=ttl_ms)
    return OK


@command("KVSTORE.UNPIN", -2, "write", (1, 1, 1), "drop a hard pin (SOFT: the soft pin)",
         "kvstore")
def unpin(front, session, args):
    soft = len(args) == 3 and bytes(args[2][:8]).upper() == b"SOFT"
    if len(args) > 3 or (len(args) == 3 and not soft):
        raise RespError("syntax error")
    front.kv.unpin(key_of(session, args[1]), soft=soft)
    return OK


#: Verbs the server answers a pipelined run of with one batch call.
RUNS = {"GET": get_run, "SET": set_run}
