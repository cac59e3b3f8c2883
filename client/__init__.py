"""kvstore client SDK: put/get (single, batch, zero-copy, tensors) and prefix keys.

    from kvstore.client import KVClient, Namespace, prefix_keys

What the SDK returns about the store are kvstore's own records
(:mod:`kvstore.types`): ``lookup`` / ``inspect`` / ``list`` give
:class:`ObjectMeta` (with :class:`Replica` and :class:`NodeAddress`),
``stat`` gives :class:`ShardStatus` (with :class:`NodeStatus` and
:class:`TierStats`); tiers are :class:`TierKind`.
"""

from kvstore.client.client import KVClient
from kvstore.errors import (ChecksumMismatch, InvalidArgument, KeyConflict, KVStoreError,
                            NoSpace, NotFound, PermissionDenied, TooLarge, Unauthenticated,
                            Unavailable)
from kvstore.tls import TlsFiles
from kvstore.keys import BlockHash, Namespace, ObjectKey, prefix_hashes, prefix_keys
from kvstore.types import (NodeAddress, NodeStatus, ObjectMeta, RemoveReason, Replica, ShardStatus,
                           TierKind, TierStats)

__all__ = ["KVClient", "Namespace", "prefix_keys", "prefix_hashes", "BlockHash", "ObjectKey",
           "KVStoreError", "NotFound", "TooLarge", "NoSpace", "Unavailable", "InvalidArgument",
           "KeyConflict", "ChecksumMismatch",
           "ObjectMeta", "Replica", "NodeAddress", "ShardStatus", "NodeStatus", "TierStats",
           "TierKind", "RemoveReason", "Unauthenticated", "PermissionDenied", "TlsFiles"]
