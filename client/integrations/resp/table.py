"""The command table: names, arities, who may run them, and the one error map.

A command is a function ``(front, session, args) -> reply`` registered under
its name with :func:`command`; :func:`dispatch` finds it, checks arity,
authentication and role, runs it and turns every failure into an error
reply. Store errors become RESP error replies in exactly one place
(:func:`store_error`), so ``KeyConflict`` reads the same from every verb::

    KeyConflict       -KEYCONFLICT KeyConflict: ... (objects are immutable)
    NoSpace           -OOM NoSpace: ...
    Unavailable       -TRYAGAIN Unavailable: ...
    PermissionDenied  -NOPERM PermissionDenied: ...
    Unauthenticated   -NOAUTH Unauthenticated: ...
    any other         -ERR <ClassName>: ...

Roles (with ``--auth``; without it every connection is admin): a command
marked ``noauth`` runs before authentication (HELLO, AUTH, QUIT), one marked
``admin`` needs the admin role (flushes, listing, KVSTORE.INSPECT / EVICT),
the rest need any role.

Tenants (:mod:`kvstore.tenants`): a connection that authenticated as
``AUTH <tenant> <token>`` acts for that tenant: every key it names is stored
as ``@<tenant>/<key>`` (:func:`key_of`), and KEYS / SCAN (flag ``tenant``)
list that tenant's keys, without the prefix. One that authenticated with
``AUTH <token>`` names keys as they are, and only keys of its token's
tenants (others: NOPERM, whatever is stored).

Thread safety: the table is filled at import and only read afterwards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from kvstore.auth import Role
from kvstore.tenants import ALL, Scope, tenant_of
from kvstore.errors import (KeyConflict, KVStoreError, NoSpace, PermissionDenied,
                            Unauthenticated, Unavailable)
from kvstore.client.integrations.resp.protocol import RespError

log = logging.getLogger(__name__)

#: (front, session, args) -> reply value (see kvstore.client.integrations.resp.protocol.encode).
Handler = Callable[..., object]


@dataclass(frozen=True, slots=True)
class Command:
    """One verb of the table."""

    name: str                 # upper case, e.g. "GET", "KVSTORE.PIN"
    handler: Handler
    arity: int                # Redis convention: N exact (name included), -N at least N
    flags: frozenset[str]     # "noauth", "admin", "write", "readonly", "fast"
    first_key: int = 0        # position of the first key argument (0: none)
    last_key: int = 0         # ... of the last (-1: the last argument)
    key_step: int = 0
    summary: str = ""         # one line, for COMMAND DOCS and the table in docs/redis.md
    group: str = "generic"


#: Upper-case name -> command. Filled by the modules of verbs (data, server).
COMMANDS: dict[str, Command] = {}


def command(name: str, arity: int, flags: str = "", keys: tuple[int, int, int] = (0, 0, 0),
            summary: str = "", group: str = "generic"):
    """Register the decorated function as verb ``name``."""
    def register(fn: Handler) -> Handler:
        COMMANDS[name.upper()] = Command(name.upper(), fn, arity, frozenset(flags.split()),
                                         *keys, summary=summary, group=group)
        return fn
    return register


@dataclass(slots=True)
class Session:
    """One connection's state: protocol, identity, name, open SCAN cursors."""

    client_id: int
    address: str                          # the peer, host:port
    role: Role | None                     # None: not authenticated yet (--auth)
    scope: Scope = ALL                    # the token's tenants (kvstore.tenants)
    tenant: str = ""                      # AUTH <tenant> <token>: keys are "@tenant/<key>"
    # What AUTH was given, and the --auth table it was checked against: a reload
    # (SIGHUP) checks it again at the next command (verbs.recheck).
    auth_user: bytes | None = field(default=None, repr=False)
    auth_token: bytes = field(default=b"", repr=False)
    auth_table: object = field(default=None, repr=False)
    proto: int = 2                        # RESP version in use (HELLO)
    name: str = ""                        # CLIENT SETNAME
    lib: dict[str, str] = field(default_factory=dict)   # CLIENT SETINFO
    cursors: dict[int, object] = field(default_factory=dict)   # SCAN cursor -> iterator
    next_cursor: int = 1
    closing: bool = False                 # QUIT: close after this reply
    buffers: object = None                # the connection's ReplyBuffers (GET values)
    get_bytes_hint: int = 8 << 20         # expected size of a GET reply (the last run's largest)


_PREFIX: dict[type[KVStoreError], str] = {
    KeyConflict: "KEYCONFLICT",
    NoSpace: "OOM",
    Unavailable: "TRYAGAIN",
    PermissionDenied: "NOPERM",
    Unauthenticated: "NOAUTH",
}


def store_error(err: KVStoreError) -> RespError:
    """The error reply of a store error (the one map; see the module docstring)."""
    text = f"{type(err).__name__}: {err}"
    if isinstance(err, KeyConflict):
        text += " (kvstore objects are immutable: DEL the key first)"
    prefix = next((p for cls, p in _PREFIX.items() if isinstance(err, cls)), "ERR")
    return RespError(text, prefix)


def _arity_ok(cmd: Command, n: int) -> bool:
    return n == cmd.arity if cmd.arity >= 0 else n >= -cmd.arity


def lookup(args: list) -> tuple[str, Command | None]:
    """The upper-case name of a command and its table entry (None: unknown)."""
    name = bytes(args[0][:64]).decode("latin-1").upper()
    return name, COMMANDS.get(name)


_DATA_FLAGS = frozenset({"readonly", "write"})
_DATA_ROLES = (Role.CLIENT, Role.ADMIN)


def dispatch(front, session: Session, args: list) -> object:
    """Run one command; the reply value, an error reply for any failure.

    Never raises for bad input or a store failure; a bug in a verb is logged
    and answered ``-ERR internal error`` (the connection stays usable).
    """
    name, cmd = lookup(args)
    if cmd is None:
        # Bytes that are not UTF-8 are shown escaped (\xe9), not re-encoded.
        shown = bytes(args[0][:64]).decode("utf-8", "backslashreplace")
        return RespError(f"unknown command '{shown}', with args beginning with: "
                         + " ".join(f"'{bytes(a[:32]).decode('utf-8', 'backslashreplace')}'"
                                    for a in args[1:4]))
    if session.role is not None and front.tokens is not None \
            and session.auth_table is not front.tokens.table:
        front.recheck(session)            # the file was reloaded: the token may be gone
    if session.role is None and "noauth" not in cmd.flags:
        return RespError("Authentication required.", "NOAUTH")
    if cmd.flags & _DATA_FLAGS and session.role not in _DATA_ROLES:
        # As on the master: a node or metrics token reads and writes no objects.
        return RespError(f"this user has no permissions to run the '{name.lower()}' command "
                         f"(role {session.role.value}: data commands need a client or admin "
                         f"token)", "NOPERM")
    if "admin" in cmd.flags and not ("tenant" in cmd.flags and session.tenant) and (
            session.role is not Role.ADMIN or session.tenant):
        return RespError(f"this user has no permissions to run the '{name.lower()}' command "
                         f"(it needs the admin role)", "NOPERM")
    if not _arity_ok(cmd, len(args)):
        return RespError(f"wrong number of arguments for '{name.lower()}' command")
    front.stats.commands += 1
    try:
        return cmd.handler(front, session, args)
    except RespError as err:
        return err
    except KVStoreError as err:
        return store_error(err)
    except Exception:                     # a bug: logged, answered, the connection lives on
        log.exception("RESP command %s failed", name)
        return RespError("internal error (see the front's log)")


def text(arg) -> str:
    """An argument as text (UTF-8). Raises: RespError: not UTF-8."""
    try:
        return bytes(arg).decode("utf-8")
    except UnicodeDecodeError:
        raise RespError("InvalidArgument: keys and names must be UTF-8") from None


def key_of(session: Session, arg) -> str:
    """The store key a connection means by the key argument ``arg``: ``@tenant/<key>``
    for a tenant connection, else the key itself.

    Raises:
        RespError: not UTF-8; or (NOPERM) a key of a tenant the connection's token is
            not bound to, refused by its name alone: nothing is confirmed.
    """
    key = text(arg)
    if session.tenant:
        return f"@{session.tenant}/{key}"
    if not session.scope.allows(key):
        raise RespError(f"this user may not touch tenant {tenant_of(key)!r}'s keys", "NOPERM")
    return key


def integer(arg, what: str = "value") -> int:
    """An argument as an integer. Raises: RespError: not one (Redis' wording)."""
    raw = bytes(arg[:24])
    try:
        if len(arg) > 20:
            raise ValueError
        return int(raw)
    except ValueError:
        raise RespError(f"{what} is not an integer or out of range") from None
