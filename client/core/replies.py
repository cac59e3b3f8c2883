"""Replies, decoded once: a node's answer as one :class:`Reply`, the masters'
per-key replies as kvstore records or errors.

Nothing past this module indexes a reply by position or reads a protobuf
status: a node's answer is a :class:`Reply` (its fields by name, its error by
:meth:`Reply.error`), and a master's Lookup, Exists and Remove replies are per
key an :class:`~kvstore.types.ObjectMeta` / bool or the key's
:class:`~kvstore.errors.KVStoreError` (with the redirect a WRONG_SHARD names).

Thread safety: pure functions and frozen records.
"""

from __future__ import annotations

from typing import Sequence

from kvstore import wire
from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import InvalidArgument, KVStoreError, WrongShard, error_for_code
from kvstore.transfer import codec
from kvstore.transfer.reply import Reply
from kvstore.types import ObjectMeta, RemoveReason


def value_error(reply: Reply, meta: ObjectMeta) -> KVStoreError | None:
    """Why a GET's ``reply`` is not ``meta``'s value (its error, a size or checksum
    that differs: CHECKSUM_MISMATCH), or None: the value is whole and intact."""
    if reply.code != pb.OK:
        return reply.error(meta.key)
    if reply.size != meta.size_bytes or codec.value_hash(reply.value) != meta.checksum:
        return error_for_code(pb.CHECKSUM_MISMATCH, "value read does not match its checksum",
                              key=meta.key)
    return None


def status_error(status: pb.Status, key: str) -> KVStoreError:
    """A per-key status that is not OK, as its error."""
    return error_for_code(status.code, status.message, key=key, redirect=status.redirect)


def lookup_results(keys: Sequence[str], resp: pb.LookupResponse
                   ) -> list[ObjectMeta | KVStoreError]:
    """Per key its metadata, or its error (NotFound, WrongShard...)."""
    return [wire.object_meta(r.meta) if r.status.code == pb.OK else status_error(r.status, k)
            for k, r in zip(keys, resp.results)]


def exists_results(keys: Sequence[str], resp: pb.ExistsResponse) -> list[bool | KVStoreError]:
    """Per key whether it is visible, or WrongShard for a key the master disowns."""
    out: list[bool | KVStoreError] = list(resp.exists)
    for j, st in enumerate(resp.statuses):
        if st.code == pb.WRONG_SHARD:
            out[j] = WrongShard(st.message, key=keys[j], redirect=st.redirect)
    return out


def remove_reason(reason: RemoveReason | str) -> RemoveReason:
    """A Remove's reason, checked before anything is asked or dropped.

    Raises:
        InvalidArgument: an unknown reason.
    """
    try:
        return RemoveReason(reason)
    except ValueError:
        raise InvalidArgument(f"unknown remove reason {reason!r}; known: "
                              f"{[r.value for r in RemoveReason]}") from None


def remove_results(keys: Sequence[str], resp: pb.RemoveResponse
                   ) -> list[ObjectMeta | KVStoreError]:
    """Per key the removed object (version, replicas), or its error (NotFound)."""
    removed = list(resp.removed) or [pb.ObjectMeta(key=k) for k in keys]   # older masters
    return [wire.object_meta(m) if s.code == pb.OK else status_error(s, k)
            for k, s, m in zip(keys, resp.statuses, removed)]
