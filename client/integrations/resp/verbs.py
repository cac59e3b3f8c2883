"""Connection and server verbs: PING, HELLO, AUTH, CLIENT, COMMAND, INFO, CONFIG,
SCAN, KEYS, DBSIZE, FLUSHALL, KVSTORE.INSPECT / EVICT.

SCAN cursors belong to their connection: a cursor is a small number naming
an open listing of the store (the SDK's ``list``, key order, all shards)
on that connection, at most :data:`MAX_CURSORS` at once (the oldest is
dropped); a cursor from another connection or front is refused. COUNT is
how many keys one call examines (default 10, at most 10,000).

Thread safety: verbs run on their connection's thread; the SDK client is shared.
"""

from __future__ import annotations

import itertools
import logging
import re

from kvstore.auth import Role
from kvstore.errors import NotFound
from kvstore.tenants import NO_TENANT, TENANT_NAME
from kvstore.client.integrations.resp.info import REDIS_VERSION, config_values, info_text
from kvstore.client.integrations.resp.protocol import OK, RespError, Status
from kvstore.client.integrations.resp.table import COMMANDS, command, integer, text

log = logging.getLogger(__name__)

MAX_CURSORS = 16
MAX_SCAN_COUNT = 10_000


@command("PING", -1, "fast", summary="PONG, or the argument back", group="connection")
def ping(front, session, args):
    if len(args) > 2:
        raise RespError("wrong number of arguments for 'ping' command")
    return bytes(args[1]) if len(args) == 2 else Status("PONG")


@command("ECHO", 2, "fast", summary="the argument back", group="connection")
def echo(front, session, args):
    return bytes(args[1])


@command("QUIT", -1, "noauth fast", summary="OK, then the connection is closed",
         group="connection")
def quit_(front, session, args):
    session.closing = True
    return OK


_ROLE_USERS = frozenset({"default", *(r.value for r in Role)})


def _authenticate(front, session, user: bytes | None, password) -> None:
    """Set the session's role and tenants from a token. The user name, if given, is
    the role (``default`` or none: any), or a tenant (Redis 6's ACL form ``AUTH
    user pass``): the connection then acts for that tenant, whose keys are
    ``@user/<key>`` (:func:`~kvstore.client.integrations.resp.table.key_of`); its
    token must be a client token bound to the tenant, or an admin's.

    Raises:
        RespError: no --auth (AUTH is refused as Redis does), or WRONGPASS.
    """
    if front.tokens is None:
        raise RespError("AUTH <password> called without any password configured for the "
                        "default user. Are you sure your configuration is correct?")
    table = front.tokens.table
    creds = front.tokens.credentials_of(bytes(password).decode("utf-8", "replace"))
    name = bytes(user).decode("utf-8", "replace") if user is not None else None
    wrong = RespError("invalid username-password pair or user is disabled.", "WRONGPASS")
    if creds is None:
        raise wrong
    role, scope = creds
    if name is None or name.lower() in _ROLE_USERS:
        if name is not None and name.lower() not in ("default", role.value):
            raise wrong
        tenant = ""
    elif not TENANT_NAME.match(name) or role not in (Role.CLIENT, Role.ADMIN) \
            or not scope.allows_tenant(name):
        raise wrong
    else:
        tenant = name
    session.role, session.scope, session.tenant = role, scope, tenant
    session.auth_user = None if user is None else bytes(user)
    session.auth_token, session.auth_table = bytes(password), table


def recheck(front, session) -> None:
    """The session's AUTH checked again against the reloaded ``--auth`` file: the
    same identity when it still holds, else the connection is not authenticated any
    more (its next command gets NOAUTH, as Redis drops a deleted ACL user's clients),
    and the SCAN cursors it opened are closed."""
    try:
        _authenticate(front, session, session.auth_user, session.auth_token)
    except RespError:
        session.role, session.scope, session.tenant = None, NO_TENANT, ""
        session.auth_user, session.auth_token, session.auth_table = None, b"", None
        session.cursors.clear()
        log.info("resp: connection %s: its token is no longer valid after a reload",
                 session.client_id)


@command("AUTH", -2, "noauth fast", summary="AUTH token | AUTH role token | AUTH tenant token "
         "(--auth; a tenant's keys are @tenant/<key>)",
         group="connection")
def auth(front, session, args):
    if len(args) > 3:
        raise RespError("syntax error")
    _authenticate(front, session, args[1] if len(args) == 3 else None, args[-1])
    return OK


@command("HELLO", -1, "noauth fast", summary="HELLO [2|3] [AUTH user pass] [SETNAME name]",
         group="connection")
def hello(front, session, args):
    proto = session.proto
    rest = args[1:]
    if rest:
        proto = integer(rest[0], "Protocol version")
        if proto not in (2, 3):
            raise RespError("unsupported protocol version", "NOPROTO")
        rest = rest[1:]
    name = None
    while rest:
        opt = bytes(rest[0][:16]).upper()
        if opt == b"AUTH" and len(rest) >= 3:
            _authenticate(front, session, rest[1], rest[2])
            rest = rest[3:]
        elif opt == b"SETNAME" and len(rest) >= 2:
            name = text(rest[1])
            rest = rest[2:]
        else:
            raise RespError(f"syntax error in HELLO option '{opt.decode('latin-1')}'")
    if session.role is None:
        raise RespError("HELLO must be called with the client already authenticated, "
                        "otherwise the HELLO <proto> AUTH <user> <pass> option can be used "
                        "to authenticate the client and select the RESP protocol version "
                        "at the same time", "NOAUTH")
    session.proto = proto
    if name is not None:
        session.name = name
    return {"server": "redis", "version": REDIS_VERSION, "proto": proto,
            "id": session.client_id, "mode": "standalone", "role": "master",
            "modules": [], "kvstore": front.version}


@command("SELECT", 2, "fast", summary="SELECT 0 (kvstore has one database)",
         group="connection")
def select(front, session, args):
    if integer(args[1]) != 0:
        raise RespError("DB index is out of range (kvstore has one database, 0)")
    return OK


@command("CLIENT", -2, "fast", summary="CLIENT SETNAME / GETNAME / SETINFO / ID / INFO",
         group="connection")
def client(front, session, args):
    sub = bytes(args[1][:16]).upper()
    if sub == b"SETNAME" and len(args) == 3:
        name = text(args[2])
        if any(c in name for c in " \n\r") or len(name) > 256:
            raise RespError("Client names cannot contain spaces, newlines or special "
                            "characters.")
        session.name = name
        return OK
    if sub == b"GETNAME" and len(args) == 2:
        return session.name or None
    if sub == b"SETINFO" and len(args) == 4:
        if len(session.lib) < 8:
            session.lib[text(args[2])[:32].lower()] = text(args[3])[:128]
        return OK
    if sub == b"ID" and len(args) == 2:
        return session.client_id
    if sub == b"INFO" and len(args) == 2:
        return (f"id={session.client_id} addr={session.address} name={session.name} db=0 "
                f"resp={session.proto} lib-name={session.lib.get('lib-name', '')} "
                f"lib-ver={session.lib.get('lib-ver', '')}\n")
    raise RespError(f"unknown subcommand or wrong number of arguments for "
                    f"'{sub.decode('latin-1')}'")


def _command_info(c) -> list:
    return [c.name.lower(), c.arity, sorted(c.flags - {"admin", "noauth"}), c.first_key,
            c.last_key, c.key_step, [], [], [], []]


@command("COMMAND", -1, "", summary="COMMAND [COUNT | DOCS [name...] | INFO [name...]]",
         group="server")
def command_(front, session, args):
    sub = bytes(args[1][:16]).upper() if len(args) > 1 else b""
    names = [text(a).upper() for a in args[2:]]
    chosen = [COMMANDS[n] for n in names if n in COMMANDS] if names else list(COMMANDS.values())
    if sub == b"":
        return [_command_info(c) for c in COMMANDS.values()]
    if sub == b"COUNT":
        return len(COMMANDS)
    if sub == b"INFO":
        return [_command_info(COMMANDS[n]) if n in COMMANDS else None for n in names] \
            if names else [_command_info(c) for c in chosen]
    if sub == b"DOCS":
        return {c.name.lower(): {"summary": c.summary, "since": "1.0.0", "group": c.group,
                                 "complexity": "", "arguments": []} for c in chosen}
    raise RespError(f"unknown subcommand '{sub.decode('latin-1')}'")


@command("INFO", -1, "", summary="server, clients, memory, stats, keyspace, kvstore sections",
         group="server")
def info(front, session, args):
    return info_text(front, [text(a).lower() for a in args[1:]], store_wide=_sees_store(session))


def _sees_store(session) -> bool:
    """Whether a connection may see store-wide figures (every tenant's objects, memory,
    counters): only one whose token sees every tenant (admin, or no --auth); a
    tenant's would learn the others' activity from them."""
    return session.scope.everything and not session.tenant


@command("CONFIG", -2, "", summary="CONFIG GET pattern... (read-only)", group="server")
def config(front, session, args):
    sub = bytes(args[1][:16]).upper()
    if sub != b"GET" or len(args) < 3:
        raise RespError("only CONFIG GET is supported (the front has no settable "
                        "configuration)")
    values = config_values(front)
    patterns = [glob_regex(text(a).lower()) for a in args[2:]]
    return {k: v for k, v in values.items() if any(p.fullmatch(k) for p in patterns)}


@command("DBSIZE", 1, "readonly fast", summary="objects readable now (as SCAN lists them), over "
         "every shard",
         group="server")
def dbsize(front, session, args):
    if _sees_store(session):
        return sum(st.num_objects for st in front.kv.stat())
    # A tenant's connection counts its own keys (listed: O(its keys), or O(the
    # store's) for a token of several tenants or of the default one).
    head = f"@{session.tenant}/" if session.tenant else ""
    allows = session.scope.allows
    return sum(1 for m in front.kv.list(head) if allows(m.key))


def glob_prefix(pattern: str) -> str:
    """The literal text a glob pattern starts with (the store lists by prefix)."""
    out = []
    for c in pattern:
        if c in "*?[\\":
            break
        out.append(c)
    return "".join(out)


def glob_regex(pattern: str) -> re.Pattern:
    """Redis' glob (``*``, ``?``, ``[a-z]``, ``[^x]``, ``\\`` escapes) as a regex.

    Raises:
        RespError: a pattern with no regex form (a range such as ``[z-a]``).
    """
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pattern[i]))
        elif c == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:j]
                neg = body.startswith("^")
                body = body[1:] if neg else body
                body = "".join(ch if ch == "-" else re.escape(ch) for ch in body)
                out.append("[" + ("^" if neg else "") + body + "]")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    try:
        return re.compile("".join(out), re.S)
    except re.error as exc:
        raise RespError(f"invalid pattern {pattern[:64]!r}: {exc}") from None


def _scan_options(args: list) -> tuple[str, int, str | None]:
    pattern, count, kind = "*", 10, None
    i = 0
    while i < len(args):
        opt = bytes(args[i][:8]).upper()
        if i + 1 >= len(args):
            raise RespError("syntax error")
        if opt == b"MATCH":
            pattern = text(args[i + 1])
        elif opt == b"COUNT":
            count = integer(args[i + 1])
            if count < 1:
                raise RespError("syntax error")
        elif opt == b"TYPE":
            kind = text(args[i + 1]).lower()
        else:
            raise RespError("syntax error")
        i += 2
    return pattern, min(count, MAX_SCAN_COUNT), kind


@command("SCAN", -2, "readonly admin tenant",
         summary="SCAN cursor [MATCH p] [COUNT n] [TYPE string]"
         " (cursors are per connection)", group="generic")
def scan(front, session, args):
    cursor = integer(args[1], "invalid cursor")
    pattern, count, kind = _scan_options(args[2:])
    head = f"@{session.tenant}/" if session.tenant else ""
    if cursor == 0:
        listing = front.kv.list(head + glob_prefix(pattern), page_size=max(count, 100))
    else:
        listing = session.cursors.pop(cursor, None)
        if listing is None:
            raise RespError("invalid cursor (SCAN cursors live on the connection that "
                            "opened them)")
    regex = glob_regex(pattern)
    batch = list(itertools.islice(listing, count))
    keys = [k for k in (m.key[len(head):] for m in batch) if regex.fullmatch(k)] \
        if kind in (None, "string") else []
    if len(batch) < count:
        return [b"0", keys]
    while len(session.cursors) >= MAX_CURSORS:
        session.cursors.pop(next(iter(session.cursors)))
    cursor = session.next_cursor
    session.next_cursor += 1
    session.cursors[cursor] = listing
    return [str(cursor).encode(), keys]


@command("KEYS", 2, "readonly admin tenant",
         summary="every key matching a pattern (lists the whole "
         "store: prefer SCAN)", group="generic")
def keys(front, session, args):
    pattern = text(args[1])
    regex = glob_regex(pattern)
    head = f"@{session.tenant}/" if session.tenant else ""     # a tenant's keys, shown without it
    return [k for k in (m.key[len(head):] for m in front.kv.list(head + glob_prefix(pattern)))
            if regex.fullmatch(k)]


def _flush(front, session, args):
    if len(args) > 2 or (len(args) == 2 and bytes(args[1][:8]).upper() not in (b"SYNC",
                                                                                 b"ASYNC")):
        raise RespError("syntax error")
    while True:
        page = [m.key for m in itertools.islice(front.kv.list(), 1000)]
        if not page:
            return OK
        front.kv.batch_remove(page)


command("FLUSHALL", -1, "write admin", summary="remove every object", group="server")(_flush)
command("FLUSHDB", -1, "write admin", summary="as FLUSHALL (one database)", group="server")(
    _flush)


@command("KVSTORE.INSPECT", 2, "readonly admin", (1, 1, 1), "a key's metadata: size, "
         "checksum, version, replicas (node and tier), access counts", "kvstore")
def inspect(front, session, args):
    try:
        m = front.kv.inspect(text(args[1]))
    except NotFound:
        return None
    return {"key": m.key, "size_bytes": m.size_bytes, "checksum": f"{m.checksum:016x}",
            "object_id": str(m.object_id), "created_ms": m.created_ms,
            "access_count": m.access_count, "last_access_ms": m.last_access_ms,
            "replicas": [f"{r.node.node_id}:{r.tier.name}" for r in m.replicas]}


@command("KVSTORE.EVICT", 2, "write admin", (1, 1, 1), "evict a key as an operator "
         "(counted as an eviction, not a removal); 1 or 0", "kvstore")
def evict(front, session, args):
    try:
        front.kv.remove(text(args[1]), reason="evict")
    except NotFound:
        return 0
    return 1

