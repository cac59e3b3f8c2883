"""kvstore client SDK: put/get (single, batch, zero-copy, tensors) and prefix keys.

    from kvstore.client import KVClient, Namespace, prefix_keys
"""

from kvstore.client.client import KVClient
from kvstore.errors import (ChecksumMismatch, InvalidArgument, KeyConflict, KVStoreError,
                            NoSpace, NotFound, PutInProgress, TooLarge, Unavailable)
from kvstore.keys import BlockHash, Namespace, ObjectKey, prefix_hashes, prefix_keys

__all__ = ["KVClient", "Namespace", "prefix_keys", "prefix_hashes", "BlockHash", "ObjectKey",
           "KVStoreError", "NotFound", "TooLarge", "NoSpace", "Unavailable", "InvalidArgument",
           "KeyConflict", "PutInProgress", "ChecksumMismatch"]
