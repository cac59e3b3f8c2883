"""A value's put as a state machine: the driver places, writes, and asks what next.

The protocol (:mod:`kvstore.client.puts` has its ordering argument): a put takes
an object id and ``replica_num`` targets from its shard's grant
(:mod:`kvstore.client.core.placement`), writes the bytes to every target, and
the targets' answers settle it (:func:`settle`). :class:`PutAttempt` holds
what one value has tried and answers each event with a :class:`Step`::

    place failed  WrongShard, first time  -> REFRESH_MAP  (then place again)
                  WrongShard again        -> DONE (the error)
                  nothing written yet     -> DONE (the shard's answer, or its masters'
                                                   silence: it stands)
                  every node failed it, Unavailable, time left
                                          -> WAIT  (pause, a fresh grant without the
                                                    nodes that failed: the shard's view
                                                    of them may have changed)
    answers       some target wrote it    -> DONE True;  already present -> DONE False
                  KeyConflict, TooLarge, InvalidArgument -> DONE (the error)
                  an id the shard does not know (a new leader)
                                          -> REGRANT once, then DONE
                  the targets could not take it -> AGAIN on other nodes, while fewer
                                          than MAX_NODES_TRIED failed it

Every step but DONE needs the call's deadline to let a new attempt start.

Thread safety: a PutAttempt belongs to one value of one call.
"""

from __future__ import annotations

import enum
from typing import Sequence

from kvstore.client.deadline import Deadline
from kvstore.errors import (AlreadyPresent, InvalidArgument, KeyConflict, KVStoreError,
                            NotFound, TooLarge, Unavailable, WrongShard)
from kvstore.rpc import check_replica_num
from kvstore.types import NodeAddress, NodeId

#: A value is tried on at most this many nodes (targets that failed it replaced) ...
MAX_NODES_TRIED = 6
#: ... in at most this many rounds.
MAX_ROUNDS = 64
#: How long a put waits before asking its shard again after every node failed it (s).
WAIT_S = 0.1


class Next(enum.Enum):
    """What the targets' answers leave to do (:func:`settle`)."""

    DONE = "done"              # the result stands
    REGRANT = "regrant"        # the shard knows no grant of the id: a new grant
    ELSEWHERE = "elsewhere"    # the targets could not take it: other nodes


class Step(enum.Enum):
    """What the driver does next for one value (the table in the module doc)."""

    DONE = "done"              # PutAttempt.result is the put's result
    AGAIN = "again"            # place again (without the nodes that failed it)
    REGRANT = "regrant"        # forget the shard's grant, then place again
    REFRESH_MAP = "refresh"    # refresh the shard map, forget the grant, place again
    WAIT = "wait"              # pause WAIT_S (within the deadline), forget the grant,
                               # call PutAttempt.waited(), place again


def replica_count(replica_num: int | None, default: int) -> int:
    """``replica_num`` (None: ``default``), checked.

    Raises:
        InvalidArgument: outside [1, MAX_REPLICAS].
    """
    n = replica_num or default
    check_replica_num(n)
    return n


def waves(keys: Sequence[str], idxs: Sequence[int]) -> list[list[int]]:
    """``idxs`` in waves, one occurrence of a key per wave: the first occurrence of a
    key repeated in one batch wins, later ones are "already present" or
    KeyConflict, as for any second put (a wave never places a key twice)."""
    out: list[list[int]] = []
    seen: dict[str, int] = {}
    for i in idxs:
        w = seen[keys[i]] = seen.get(keys[i], -1) + 1
        if w == len(out):
            out.append([])
        out[w].append(i)
    return out


def settle(key: str, written: Sequence[NodeAddress],
           failures: Sequence[tuple[NodeAddress, KVStoreError]]
           ) -> tuple[bool | KVStoreError, Next]:
    """A placed put's result from its targets' answers, and what is left to do.

    Returns:
        (True: some target acknowledged; False: already present; or the error), and
        :class:`Next`.
    """
    if written:
        return True, Next.DONE
    errs = [e for _n, e in failures]
    if any(isinstance(e, AlreadyPresent) for e in errs):
        return False, Next.DONE
    decided = next((e for e in errs if isinstance(e, (KeyConflict, TooLarge, InvalidArgument))),
                   None)
    if decided is not None:
        return decided, Next.DONE
    err = errs[0] if errs else Unavailable("no target node accepted the value", key=key)
    if any(isinstance(e, NotFound) for e in errs):
        return err, Next.REGRANT
    return err, Next.ELSEWHERE


class PutAttempt:
    """One value's put across its rounds.

    Attributes:
        key: the value's key.
        failed: the nodes that could not take it (left out of the next placement).
        result: True (written), False (already present) or the error, so far.
    """

    __slots__ = ("key", "failed", "result", "_regranted", "_refreshed", "_rounds")

    def __init__(self, key: str):
        self.key = key
        self.failed: set[NodeId] = set()
        self.result: bool | KVStoreError = Unavailable("no target node accepted the value",
                                                       key=key)
        self._regranted = False
        self._refreshed = False
        self._rounds = 0

    @property
    def exclude(self) -> frozenset[NodeId]:
        return frozenset(self.failed)

    def place_failed(self, err: KVStoreError, deadline: Deadline) -> Step:
        """Placing the value failed with ``err`` (no grant, no node left, WrongShard...)."""
        if isinstance(err, WrongShard):
            err.key = err.key or self.key
            if self._refreshed:
                self.result = err
                return Step.DONE
            self._refreshed = True          # a stale map: refreshed once, as routed calls
            return Step.REFRESH_MAP
        if not self.failed:
            self.result = err               # the shard's answer, or its masters' silence
            return Step.DONE
        if (isinstance(err, Unavailable) and isinstance(self.result, Unavailable)
                and self._more(deadline)):
            return Step.WAIT
        return Step.DONE                    # the last round's error stands

    def waited(self) -> None:
        """The driver paused after :attr:`Step.WAIT`: every node may be tried again."""
        self.failed.clear()

    def answered(self, written: Sequence[NodeAddress],
                 failures: Sequence[tuple[NodeAddress, KVStoreError]],
                 deadline: Deadline) -> Step:
        """The targets answered: ``written`` took the bytes, ``failures`` did not."""
        self.result, then = settle(self.key, written, failures)
        if then is Next.DONE or not self._more(deadline):
            return Step.DONE
        self.failed |= {n.node_id for n, e in failures if not isinstance(e, NotFound)}
        if then is Next.REGRANT:
            if self._regranted:
                return Step.DONE            # refused twice: the error stands
            self._regranted = True
            return Step.REGRANT
        return Step.AGAIN if len(self.failed) < MAX_NODES_TRIED else Step.DONE

    def _more(self, deadline: Deadline) -> bool:
        self._rounds += 1
        return self._rounds < MAX_ROUNDS and deadline.may_retry()


def split_answers(key: str, targets: Sequence[NodeAddress], answers: Sequence
                  ) -> tuple[list[NodeAddress], list[tuple[NodeAddress, KVStoreError]]]:
    """The targets that took the bytes, and the others with their errors, from each
    target's answer (a :class:`~kvstore.transfer.reply.Reply`, or the error the
    transfer failed with)."""
    written, failures = [], []
    for t, a in zip(targets, answers):
        err = a if isinstance(a, KVStoreError) else a.error(key)
        if err is None:
            written.append(t)
        else:
            failures.append((t, err))
    return written, failures
