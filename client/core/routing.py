"""Routing: a call about keys goes to the shard owning each key's hash slot, and
WRONG_SHARD is handled here, once, the same way for every routed call of both SDKs.

A :class:`Route` plans the rounds of one routed call::

    round 1   one call per shard (of at most MAX_KEYS_PER_CALL keys) in the map held
    answered  per key a result; WRONG_SHARD (per key, or a whole call) marks the key moved
    refresh   some moved in round 1: the driver refreshes the shard map, once
    round 2   the moved keys only; a second WRONG_SHARD is their result

A key that is not a ``str`` or not UTF-8 (a lone surrogate) cannot be routed
nor sent: its result is ``invalid(InvalidArgument)`` and no master sees it.

Thread safety: a Route belongs to one call.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Callable, Sequence

from kvstore.errors import InvalidArgument, KVStoreError, WrongShard
from kvstore.rpc import MAX_KEYS_PER_CALL
from kvstore.shardmap import ShardMap

log = logging.getLogger(__name__)

#: One call of a round: (the shard's masters, the indices of its keys, those keys).
Call = tuple[tuple[str, ...], list[int], list[str]]


def unroutable(key) -> InvalidArgument | None:
    """Why ``key`` cannot be routed or sent to a master, or None."""
    if not isinstance(key, str):
        return InvalidArgument(f"key must be str, got {type(key).__name__}")
    try:
        key.encode()
    except UnicodeEncodeError:
        return InvalidArgument("key is not valid UTF-8 (a lone surrogate)", key=repr(key))
    return None


def group(shard_map: ShardMap, keys: Sequence[str], idxs: list[int]) -> list[Call]:
    """``idxs`` (of ``str`` keys) by the masters of the shard owning each key, in calls
    of at most :data:`~kvstore.rpc.MAX_KEYS_PER_CALL` keys."""
    ranges = shard_map.ranges
    if len(ranges) == 1:     # one shard: no per-key hashing
        groups = {ranges[0].addresses: idxs}
    else:
        groups = defaultdict(list)
        for i in idxs:
            groups[shard_map.shard_for_key(keys[i]).addresses].append(i)
    n = MAX_KEYS_PER_CALL
    return [(addresses, part[j:j + n], [keys[i] for i in part[j:j + n]])
            for addresses, part in groups.items() for j in range(0, len(part), n)]


class Route:
    """The rounds of one routed call (the module doc).

    Args:
        keys: the call's keys, in the caller's order.
        invalid: the result of a key that cannot be routed, from its InvalidArgument.
        per_key_errors: whether a shard's failure (its masters unreachable) becomes
            its keys' results (True), or the call's error (False: results that
            cannot hold an error, as Exists').

    Attributes:
        out: per key its result so far, in input order.
    """

    def __init__(self, keys: Sequence[str],
                 invalid: Callable[[KVStoreError], object] = lambda err: err,
                 per_key_errors: bool = True):
        self.keys = keys
        self.per_key_errors = per_key_errors
        self.out: list = [unroutable(k) for k in keys]
        self._todo = [i for i, r in enumerate(self.out) if r is None]
        for i, r in enumerate(self.out):
            if r is not None:
                self.out[i] = invalid(r)
        self._moved: list[int] = []
        self._round = 0

    def calls(self, shard_map: ShardMap) -> list[Call]:
        """This round's calls, by the map the driver holds now."""
        self._round += 1
        self._moved = []
        return group(shard_map, self.keys, self._todo)

    def answered(self, call: Call, results: Sequence) -> None:
        """One call's per-key results (a value, or the key's error)."""
        for i, r in zip(call[1], results):
            self.out[i] = r
            if isinstance(r, WrongShard):
                self._moved.append(i)

    def failed(self, call: Call, err: KVStoreError) -> None:
        """One call failed whole with ``err``.

        Raises:
            KVStoreError: ``err``, when results cannot hold it (``per_key_errors`` False)
                and it is no WRONG_SHARD.
        """
        if isinstance(err, WrongShard):
            self.answered(call, [WrongShard(err.message, key=k, redirect=err.redirect)
                                 for k in call[2]])
        elif not self.per_key_errors:
            raise err
        else:
            self.answered(call, [type(err)(err.message, key=k) for k in call[2]])

    def wants_refresh(self, map_version: int = 0) -> bool:
        """Whether the driver refreshes the shard map and runs one more round (keys
        moved in the first round), or the call is done (:attr:`out`)."""
        if not self._moved or self._round > 1:
            return False
        log.info("WRONG_SHARD for %d key(s) on shard map v%d: refreshing it",
                 len(self._moved), map_version)
        self._todo = self._moved
        return True
