"""Tenants: whose a key is, which tenants a token may touch, and each tenant's quota.

A shared store serves several teams, models and customers. A key belongs to
exactly one tenant, read from the key itself (the same answer on the client,
the master and every node, with no lookup)::

    @acme/3f2a...     tenant "acme"     (a key that starts with "@NAME/")
    3f2a..., w-1      tenant "default"  (every other key)

:func:`kvstore.keys.prefix_keys` of a :class:`~kvstore.keys.Namespace` whose
``tenant`` is set makes such keys (the tenant is also hashed into the
namespace id), so two tenants never share a key by construction.

The ``--auth`` file binds tokens to tenants and sets quotas (the grammar is
:func:`kvstore.auth.parse_tokens`'s)::

    client   TOKEN_A   tenants=acme          # acme's keys only
    client   TOKEN_AB  tenants=acme,beta
    client   TOKEN_0                         # no tenants=: the default tenant only
    metrics  TOKEN_M   tenants=acme          # acme's events and figures only
    admin    TOKEN_X                         # every tenant (admin is never scoped)
    node     TOKEN_N                         # nodes act for the store
    tenant   beta  bytes=100MiB objects=1000000 share=20%

A scoped caller asking for another tenant's key is answered as if the key did
not exist (NotFound, never PERMISSION_DENIED: a denial would confirm the key).

A quota (:class:`Quota`): ``bytes`` and ``objects`` are hard limits over the
tenant's whole store (a put beyond one is NoSpace naming the tenant and its
figures); ``share`` is its guaranteed part of each node's memory (bytes, or a
percentage of the node's capacity): when a node must evict, tenants over their
share lose objects first, so one tenant's pressure does not evict another's
objects while that one is within its share. A tenant with no ``tenant`` line
has no limits and no guaranteed share.

Thread safety: everything here is immutable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

#: The tenant of every key that names none, and of tokens bound to none.
DEFAULT_TENANT = "default"
#: Tenant names: what may follow "@" in a key; also the RESP front's ACL user names.
TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")
_KEY_TENANT = re.compile(r"@([A-Za-z0-9_.-]{1,64})/")
#: Tenants one token may be bound to, and ``tenant`` lines in one file.
MAX_TENANTS = 1000

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10 ** 6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10 ** 9, "gib": 1 << 30, "t": 1 << 40,
          "tb": 10 ** 12, "tib": 1 << 40}
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\Z")
_COUNT = re.compile(r"[0-9]+\Z")
_PERCENT = re.compile(r"([0-9]+(?:\.[0-9]+)?)%\Z")


def tenant_of(key: str) -> str:
    """The tenant a key belongs to: NAME for ``"@NAME/..."``, else :data:`DEFAULT_TENANT`."""
    if key[:1] != "@":
        return DEFAULT_TENANT
    m = _KEY_TENANT.match(key)
    return m.group(1) if m else DEFAULT_TENANT


def tenant_key(tenant: str, key: str) -> str:
    """``key`` made a key of ``tenant`` (``"@tenant/key"``; the default tenant's keys
    carry no prefix).

    Raises:
        ValueError: ``tenant`` is not a valid tenant name.
    """
    check_name(tenant)
    return key if tenant == DEFAULT_TENANT else f"@{tenant}/{key}"


def check_name(tenant: str) -> str:
    """``tenant`` if it is a valid tenant name.

    Raises:
        ValueError: it is not (1-64 of ``A-Z a-z 0-9 _ . -``).
    """
    if not isinstance(tenant, str) or not TENANT_NAME.match(tenant):
        raise ValueError(f"bad tenant name {tenant!r}: 1-64 of A-Z a-z 0-9 _ . -")
    return tenant


def parse_size(text: str) -> int:
    """Bytes from ``"100MiB"``, ``"1.5GiB"``, ``"4096"``, ``"10GB"``.

    Raises:
        ValueError: not a size.
    """
    m = _SIZE.match(text.strip())
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if unit is None:
        raise ValueError(f"bad size {text!r} (e.g. 4096, 100MiB, 1.5GiB)")
    return int(float(m.group(1)) * unit)


@dataclass(frozen=True, slots=True)
class Scope:
    """The tenants a caller may touch. ``tenants`` None: every tenant (admin, node)."""

    tenants: frozenset[str] | None = None

    def allows(self, key: str) -> bool:
        """Whether the caller may touch ``key``."""
        return self.tenants is None or tenant_of(key) in self.tenants

    def allows_tenant(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants

    @property
    def everything(self) -> bool:
        return self.tenants is None


#: The scope of admin and node tokens, and of every caller when auth is off.
ALL = Scope(None)
#: The scope of a caller that may touch no key: not authenticated yet, or its token
#: gone from the file after a reload.
NO_TENANT = Scope(frozenset())
#: The scope of a client or metrics token bound to no tenant.
DEFAULT_ONLY = Scope(frozenset({DEFAULT_TENANT}))


@dataclass(frozen=True, slots=True)
class Quota:
    """One tenant's limits (0: none).

    Attributes:
        max_bytes: hard limit on the bytes of the tenant's objects in the store
            (each object once, whatever its replicas).
        max_objects: hard limit on its objects.
        share_bytes: guaranteed bytes of each node's memory.
        share_fraction: guaranteed fraction of each node's memory (0..1);
            a node uses the larger of the two.
    """

    max_bytes: int = 0
    max_objects: int = 0
    share_bytes: int = 0
    share_fraction: float = 0.0

    def share_of(self, capacity_bytes: int) -> int:
        """The guaranteed bytes on a node of ``capacity_bytes``."""
        return max(self.share_bytes, int(self.share_fraction * capacity_bytes))


NO_QUOTA = Quota()


def parse_quota(fields: list[str], where: str) -> tuple[str, Quota]:
    """A ``tenant NAME [bytes=SIZE] [objects=N] [share=SIZE|PCT%]`` line's fields
    (after ``tenant``) as (name, quota).

    Raises:
        ValueError: a bad name, field or value (the message starts with ``where``).
    """
    if not fields:
        raise ValueError(f"{where}: expected 'tenant NAME [bytes=SIZE] [objects=N] [share=SIZE|PCT%]'")
    try:
        name = check_name(fields[0])
        values: dict[str, int | float] = {}
        seen: set[str] = set()
        for field in fields[1:]:
            k, sep, v = field.partition("=")
            if not sep or k in seen:
                raise ValueError(f"bad or repeated field {field!r}")
            seen.add(k)
            if k == "bytes":
                values["max_bytes"] = parse_size(v)
            elif k == "objects":
                if not _COUNT.match(v):
                    raise ValueError(f"objects={v!r} is not a count (digits 0-9)")
                values["max_objects"] = int(v)
            elif k == "share" and v.endswith("%"):
                m = _PERCENT.match(v)
                frac = float(m.group(1)) / 100 if m else -1.0
                if not 0 <= frac <= 1:
                    raise ValueError(f"share {v} is not within 0-100%")
                values["share_fraction"] = frac
            elif k == "share":
                values["share_bytes"] = parse_size(v)
            else:
                raise ValueError(f"unknown field {k!r} (bytes, objects, share)")
        if any(v < 0 for v in values.values()):
            raise ValueError("negative limit")
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return name, Quota(**values)


def config_lines(text: str, source: str) -> Iterator[tuple[str, list[str]]]:
    """The words of each line of an ``--auth`` file or etcd value that says something
    (``#`` starts a comment), with where it stands (``source:line``)."""
    for n, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if words:
            yield f"{source}:{n}", words


def add_quota(quotas: dict[str, Quota], fields: list[str], where: str) -> None:
    """Parse a ``tenant`` line's fields (after ``tenant``) into ``quotas``.

    Raises:
        ValueError: as :func:`parse_quota`, or a tenant already in ``quotas``, or
            MAX_TENANTS of them already.
    """
    name, quota = parse_quota(fields, where)
    if name in quotas or len(quotas) >= MAX_TENANTS:
        raise ValueError(f"{where}: tenant {name!r} listed twice, or over "
                         f"{MAX_TENANTS} tenant lines")
    quotas[name] = quota


def parse_scope(field: str, where: str) -> Scope:
    """A token line's ``tenants=a,b`` field as a :class:`Scope`.

    Raises:
        ValueError: not ``tenants=`` with 1..MAX_TENANTS valid names.
    """
    k, sep, v = field.partition("=")
    names = [n for n in v.split(",") if n]
    if k != "tenants" or not sep or not names or len(names) > MAX_TENANTS:
        raise ValueError(f"{where}: expected 'tenants=NAME[,NAME...]', got {field!r}")
    try:
        return Scope(frozenset(check_name(n) for n in names))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
