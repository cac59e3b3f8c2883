"""Master failover: the one retry rule of every master call of both SDKs.

A shard is served by one or more masters (a leader and standbys). A call goes
to the one that answered last; what it does after an error is decided here,
and only here:

    error                                   action
    not retryable (NotFound, WrongShard...) FAIL: the call's error
    NoLiveNode                              FAIL: the shard's answer, not its silence
    IndexIncomplete / NodesLate             WAIT: the same master, after a short pause
    any other UNAVAILABLE                   NEXT: the leader a standby named, else the
                                            next master (a one-master shard: the same,
                                            ``MASTER_ATTEMPTS`` tries in all)

All of it within the call's one deadline (:mod:`kvstore.client.deadline`): no
attempt starts after ``retry_until`` and none runs past ``end``.

:func:`classify` is the one place that tells these errors apart, by their
classes (:mod:`kvstore.errors`; a master sends the class in its status details),
never by their messages.

Thread safety: a :class:`MasterRetry` belongs to one call; the ``leaders``
table it updates takes one assignment per update.
"""

from __future__ import annotations

import enum

from kvstore.client.deadline import Deadline
from kvstore.errors import (RETRYABLE, IndexIncomplete, KVStoreError, NodesLate, NoLiveNode,
                            NotLeader, Unavailable)

#: Attempts of a master call on UNAVAILABLE with a one-master shard (a master asking
#: to be waited on is not counted).
MASTER_ATTEMPTS = 3


class Action(enum.Enum):
    """What a master call does after an error."""

    FAIL = "fail"      # the call fails with the error
    WAIT = "wait"      # ask the same master again after a short pause (it warms up)
    NEXT = "next"      # ask another master (the named leader, else the next)


def classify(err: KVStoreError) -> Action:
    """What a master call does after ``err`` (the table in the module doc)."""
    if not isinstance(err, RETRYABLE) or isinstance(err, NoLiveNode):
        return Action.FAIL
    if isinstance(err, (IndexIncomplete, NodesLate)):
        return Action.WAIT
    return Action.NEXT


def leader_hint(err: KVStoreError) -> str:
    """The leader a standby named in its refusal (:attr:`NotLeader.leader`), or ""."""
    return err.leader if isinstance(err, NotLeader) else ""


def next_master(addresses: tuple[str, ...], at: int, err: KVStoreError) -> int:
    """Which of a shard's masters a call tries after ``addresses[at]`` answered ``err``."""
    if classify(err) is Action.WAIT:
        return at
    hint = leader_hint(err)
    if hint in addresses and hint != addresses[at]:
        return addresses.index(hint)
    return (at + 1) % len(addresses)


class MasterRetry:
    """One master call's attempts: where each goes, the pause between them, the end.

    A driver iterates over its attempts (one object, yielded again for each)::

        for attempt in MasterRetry(addresses, leaders, deadline, timeout_s):
            try:   return attempt.answered(rpc(attempt.address, timeout=attempt.timeout_s))
            except RpcError as exc:
                   pause(attempt.failed(from_rpc_error(exc)))   # raises when it gives up

    Args:
        addresses: the shard's masters.
        leaders: the client's table, shard masters -> index of the one that answered
            last; read for the first attempt, updated as masters answer.
        deadline: the call's.
        timeout_s: the gRPC deadline of one attempt (cut to what the call has left).

    Attributes:
        at: the index of the master the next attempt goes to.
    """

    def __init__(self, addresses: tuple[str, ...], leaders: dict[tuple[str, ...], int],
                 deadline: Deadline, timeout_s: float = 10.0):
        self.addresses = addresses
        self.timeout_s_max = timeout_s
        self.leaders = leaders
        self.at = leaders.get(addresses, 0)
        self.deadline = deadline
        self._failures = 0     # answers that were neither waited on nor the last
        self._last: KVStoreError | None = None   # the last error, for the final one

    def __iter__(self):
        while True:
            yield self

    @property
    def timeout_s(self) -> float:
        """The gRPC deadline of the next attempt (:meth:`attempt_s` of ``timeout_s``)."""
        return self.attempt_s(self.timeout_s_max)

    @property
    def address(self) -> str:
        """The master the next attempt goes to."""
        return self.addresses[self.at]

    def attempt_s(self, timeout_s: float) -> float:
        """The gRPC deadline of the next attempt: ``timeout_s`` cut to what is left.

        Raises:
            Unavailable: nothing is left.
        """
        t = self.deadline.bound(timeout_s)
        if t <= 0.0:
            last = (f"; the last answer: {type(self._last).__name__}: {self._last.message}"
                    if self._last is not None else "; no attempt was made")
            raise Unavailable(f"the call's deadline passed before master "
                              f"{self.address} could be asked{last}")
        return t

    def answered(self, response):
        """The master at :attr:`at` answered: it is asked first next time. Returns ``response``."""
        self.leaders[self.addresses] = self.at
        return response

    def failed(self, err: KVStoreError) -> float:
        """The pause before the next attempt after ``err`` (:attr:`at` names where it goes).

        Raises:
            KVStoreError: ``err``, when the call gives up.
        """
        self._last = err
        pause = self.after(err)
        if pause is None:
            raise err
        return pause

    def after(self, err: KVStoreError) -> float | None:
        """As :meth:`failed`, None instead of raising."""
        action = classify(err)
        if action is Action.FAIL or not self.deadline.may_retry():
            return None
        if action is Action.WAIT:
            if len(self.addresses) > 1:
                self.leaders[self.addresses] = self.at   # it won the election and warms up
            return self._pause(0.05)
        self._failures += 1
        if len(self.addresses) == 1:
            if self._failures >= MASTER_ATTEMPTS:
                return None
            return self._pause(0.05 * 2 ** (self._failures - 1))
        self.at = next_master(self.addresses, self.at, err)
        return self._pause(0.1 if self._failures % len(self.addresses) == 0 else 0.0)

    def _pause(self, s: float) -> float:
        return min(s, max(0.0, self.deadline.left_s()))
