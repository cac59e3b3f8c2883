"""Object keys: chained prefix hashes of token blocks.

A :class:`Namespace` says whose KV this is (model and revision, KV dtype and
layout, block size, tensor-parallel rank, adapter, tenant, salt). It is
encoded canonically -- typed, length-prefixed fields in a fixed order -- and
hashed into a 16-byte namespace id. Block ``i`` of a token sequence gets::

    key_i = xxh3_128(key_{i-1} || u32le(len(tokens_i)) || u32le tokens_i || extra_i)
    key_-1 = namespace id

so a key names the whole prefix up to and including block ``i`` (DESIGN.md,
"Keys"; Mooncake FAST'25 §3 uses the same chained-prefix scheme). Only full
blocks get keys. The function is pure: no ``hash()``, no process state, the
same bytes on every machine and after restarts; golden vectors in
``tests/unit/test_keys.py`` pin it.
"""

from __future__ import annotations

import dataclasses
import re
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument
from kvstore.tenants import DEFAULT_TENANT, TENANT_NAME, tenant_key
from kvstore.types import BlockHash, ObjectKey

MAX_KEY_BYTES = 512
NUM_SLOTS = 16384
_SCHEMA_VERSION = 1


def _field(tag: int, payload: bytes) -> bytes:
    return struct.pack("<BI", tag, len(payload)) + payload


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything besides the tokens that decides a KV block's bytes.

    Attributes:
        model: model id, e.g. ``"meta-llama/Llama-3-8B"``.
        revision: weights revision (commit or checksum of the weights).
        kv_dtype: element type of the KV, e.g. ``"float32"``, ``"bfloat16"``.
        num_layers, num_kv_heads, head_dim: KV layout; an object is
            ``[num_layers, 2, block_tokens, num_kv_heads, head_dim]``.
        block_tokens: tokens per block.
        tp_rank, tp_size: tensor-parallel rank and size.
        adapter: LoRA / adapter id, "" for none.
        tenant: tenant id, "" for a shared cache.
        salt: extra isolation salt (e.g. per-user cache salting).
    """

    model: str
    revision: str = ""
    kv_dtype: str = "float32"
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    block_tokens: int = 16
    tp_rank: int = 0
    tp_size: int = 1
    adapter: str = ""
    tenant: str = ""
    salt: str = ""

    def encode(self) -> bytes:
        """Canonical bytes: schema version, then each field tagged and length-prefixed."""
        out = [struct.pack("<I", _SCHEMA_VERSION)]
        tag = 0
        for value in (self.model, self.revision, self.kv_dtype):
            tag += 1
            out.append(_field(tag, value.encode()))
        for value in (self.num_layers, self.num_kv_heads, self.head_dim, self.block_tokens,
                      self.tp_rank, self.tp_size):
            tag += 1
            out.append(_field(tag, struct.pack("<q", value)))
        for value in (self.adapter, self.tenant, self.salt):
            tag += 1
            out.append(_field(tag, value.encode()))
        return b"".join(out)

    def id(self) -> bytes:
        """16-byte namespace id: xxh3-128 of :meth:`encode`."""
        return xxhash.xxh3_128_digest(self.encode())

    def block_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one full block object for an element size of ``dtype_bytes``."""
        return self.num_layers * 2 * self.block_tokens * self.num_kv_heads * self.head_dim * dtype_bytes


def _tokens_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgument(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise InvalidArgument("token ids must fit in uint32")
    return arr.astype("<u4", copy=False).tobytes()


def prefix_hashes(tokens: Sequence[int] | np.ndarray, namespace: Namespace,
                  extra: Sequence[bytes] | None = None) -> list[bytes]:
    """Raw 16-byte chained hashes, one per full block of ``tokens``.

    Args:
        tokens: token ids (uint32 range), any length; a trailing partial
            block gets no hash.
        namespace: whose KV this is; ``namespace.block_tokens`` sets the block size.
        extra: optional per-block extra bytes (adapter id, multimodal content
            hash and offset), one entry per full block; ``b""`` for none.

    Raises:
        InvalidArgument: bad token ids, block size, or ``extra`` length.
    """
    b = namespace.block_tokens
    if b <= 0:
        raise InvalidArgument(f"block_tokens must be > 0, got {b}")
    data = _tokens_bytes(tokens)
    num_blocks = len(data) // 4 // b
    if extra is not None and len(extra) < num_blocks:
        raise InvalidArgument(f"extra has {len(extra)} entries for {num_blocks} blocks")
    prev = namespace.id()
    step = 4 * b
    header = struct.pack("<I", b)
    out = []
    for i in range(num_blocks):
        h = xxhash.xxh3_128()
        h.update(prev)
        h.update(header)
        h.update(data[i * step:(i + 1) * step])
        if extra is not None and extra[i]:
            h.update(struct.pack("<I", len(extra[i])))
            h.update(extra[i])
        prev = h.digest()
        out.append(prev)
    return out


def prefix_keys(tokens: Sequence[int] | np.ndarray, namespace: Namespace,
                extra: Sequence[bytes] | None = None) -> list[BlockHash]:
    """Store keys (32 lowercase hex digits) of each full block's prefix.

    ``prefix_keys(t, ns)[i]`` names the KV of ``t[: (i + 1) * ns.block_tokens]``.
    A namespace with a ``tenant`` (other than ``"default"``) makes keys of that
    tenant: ``"@TENANT/" + hex`` (:mod:`kvstore.tenants`). See
    :func:`prefix_hashes` for arguments and errors.

    Raises:
        InvalidArgument: as :func:`prefix_hashes`, or a tenant that is not a tenant name.
    """
    hashes = prefix_hashes(tokens, namespace, extra)
    if not namespace.tenant or namespace.tenant == DEFAULT_TENANT:
        return [BlockHash(h.hex()) for h in hashes]
    try:
        head = tenant_key(namespace.tenant, "")
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    return [BlockHash(head + h.hex()) for h in hashes]


def valid_tenant(tenant: str) -> bool:
    """Whether ``tenant`` may name a request's tenant: "" (the default) or a tenant name."""
    return not tenant or bool(TENANT_NAME.match(tenant))


def tenant_namespace(namespace: Namespace, tenant: str) -> Namespace:
    """``namespace`` for ``tenant``'s KV (a request's tenant: the OpenAI front's token's,
    docs/tenants.md); ``namespace`` itself for "" and the default tenant.

    Raises:
        InvalidArgument: ``tenant`` is not a tenant name.
    """
    if not tenant or tenant == DEFAULT_TENANT or tenant == namespace.tenant:
        return namespace
    if not TENANT_NAME.match(tenant):
        raise InvalidArgument(f"bad tenant {tenant[:80]!r}: 1-64 of A-Z a-z 0-9 _ . -")
    return dataclasses.replace(namespace, tenant=tenant)


# One search instead of a Python loop over the characters: every key of every
# call passes here, on the client and again on its master shard.
_CONTROL_CHARS = re.compile("[\x00-\x1f\x7f-\x9f]")     # C0, DEL and C1


def validate_key(key: str) -> ObjectKey:
    """Check a user key: a non-empty ``str`` of at most MAX_KEY_BYTES UTF-8 bytes.

    Raises:
        InvalidArgument: empty, not a string, not encodable as UTF-8, too long, or
            with NUL / control chars.
    """
    if not isinstance(key, str):
        raise InvalidArgument(f"key must be str, got {type(key).__name__}")
    if not key:
        raise InvalidArgument("key must not be empty")
    try:
        size = len(key.encode())
    except UnicodeEncodeError:
        raise InvalidArgument("key is not valid UTF-8 (a lone surrogate)", key=repr(key)) from None
    if size > MAX_KEY_BYTES:
        raise InvalidArgument(f"key is {size} bytes, max {MAX_KEY_BYTES}", key=key[:64])
    if _CONTROL_CHARS.search(key):
        raise InvalidArgument("key must not contain control characters", key=repr(key))
    return ObjectKey(key)


def key_list(keys, validate: bool = True) -> list[ObjectKey]:
    """The keys of a batch call as a list, each checked (``validate``) as :func:`validate_key`.

    Raises:
        InvalidArgument: one ``str`` or ``bytes`` instead of a sequence of keys
            (``batch_put("ab", ...)`` would put keys "a" and "b"), or a bad key.
    """
    if isinstance(keys, (str, bytes, bytearray)):
        raise InvalidArgument(f"keys must be a sequence of str, got one {type(keys).__name__}")
    out = list(keys)
    if validate:
        for key in out:
            validate_key(key)
    return out


def key_slot(key: str) -> int:
    """Hash slot of a key in [0, NUM_SLOTS): xxh3-64 of its UTF-8 bytes."""
    return xxhash.xxh3_64_intdigest(key.encode()) % NUM_SLOTS


def value_checksum(data) -> int:
    """xxh3-64 of a value (any buffer); the checksum stored in object metadata."""
    return xxhash.xxh3_64_intdigest(data)
