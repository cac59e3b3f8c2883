"""Every kvstore gRPC server and channel: one options table, authentication, TLS.

    SERVER_OPTIONS    every grpc.aio server (masters, engines, conductor)
    CHANNEL_OPTIONS   every channel to them (SDK, store nodes, conductor, tools)

Messages may carry up to :data:`MAX_MESSAGE_BYTES` (a Lookup of thousands
of keys, a node's inventory). Servers bind exclusively: gRPC sets
SO_REUSEPORT by default, and a second server on a busy port would start
"fine" and split the clients between two processes. Channels reconnect to a
restarted peer within about a second (gRPC's default backoff grows to two
minutes; here it stops at 1 s, so store nodes are back with a restarted
master well inside its warm-up). A channel with a call in flight pings its
peer every :data:`KEEPALIVE_MS`; a peer that stops answering (a host cut off
by a partition: no reset, just silence) fails the call with UNAVAILABLE
after about twice that, so the SDK moves on to a standby before the call's
own deadline; servers accept those pings.

Security (:mod:`kvstore.auth`, :mod:`kvstore.tls`): a server given a token
file checks every call in one interceptor (:class:`AuthInterceptor`) against
its service's table of which roles may call which method: no or an unknown
token is UNAUTHENTICATED, a role that may not is PERMISSION_DENIED. A
channel given a token sends it as ``authorization: Bearer``; with TLS files
it is a secure channel (mutual TLS when it has a certificate).

Bad input gets a typed status, never UNKNOWN (:class:`TypedErrors`, on
every server): a request that cannot be parsed is INVALID_ARGUMENT, and a
:class:`~kvstore.errors.KVStoreError` that escapes a handler gets its status
from the one table in :mod:`kvstore.errors`, with its ``ErrorDetail`` in the
trailing metadata (:func:`abort`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

import grpc

from kvstore.auth import Role, TokenFile, allows, bearer, client_token  # noqa: F401 (bearer: re-exported)
from kvstore.binding import split_address
from kvstore.errors import InvalidArgument, KVStoreError, error_detail, status_code
from kvstore.tenants import ALL, NO_TENANT, Scope
from kvstore.tls import TlsFiles, grpc_channel_credentials, grpc_server_credentials

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

#: Keys in one Lookup, Exists or Remove call, at most. A
#: larger call is INVALID_ARGUMENT (the limit in the message): one call of a
#: million keys held a master's event loop for 2 s. The SDK splits larger
#: batches into calls of this many keys by itself.
MAX_KEYS_PER_CALL = 10_000

#: Most replicas one put may ask for (GrantPlacement, a node's write frame).
MAX_REPLICAS = 16


def check_replica_num(replica_num: int, *, unset_ok: bool = False, key: str | None = None,
                      what: str = "replica_num") -> None:
    """The one bound on a put's replica count, wherever it is checked (the SDKs, the
    master's grants and inventories, a node's write frame): 1 to :data:`MAX_REPLICAS`,
    or 0 where ``unset_ok`` (a wire field not set: one replica).

    Raises:
        InvalidArgument: out of bounds (nothing was changed).
    """
    low = 0 if unset_ok else 1
    if not low <= replica_num <= MAX_REPLICAS:
        raise InvalidArgument(f"{what} must be in [{low}, {MAX_REPLICAS}], got {replica_num}",
                              key=key)

_MESSAGE_SIZES = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]

KEEPALIVE_MS = 1000

SERVER_OPTIONS: list[tuple[str, int]] = _MESSAGE_SIZES + [
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]

CHANNEL_OPTIONS: list[tuple[str, int]] = _MESSAGE_SIZES + [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
    ("grpc.http2.max_pings_without_data", 0),
]

#: The standard health service answers everyone: probes carry no tokens, and it
#: tells nothing but SERVING / NOT_SERVING (kvstore.health).
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"

#: Method -> the roles that may call it (admin may call everything; absent: admin only).
MethodRoles = Mapping[str, frozenset[Role]]


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """How a server authenticates its callers and protects its ports."""

    tokens: TokenFile | None = None   # --auth: None, every caller is trusted (loopback only)
    tls: TlsFiles | None = None       # --tls-cert/--tls-key[/--tls-ca]: None, plaintext

    def role_of(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Role | None:
        """The caller's role from its call metadata (admin when auth is off), or None."""
        if self.tokens is None:
            return Role.ADMIN
        return self.tokens.role_of(bearer(metadata))

    def scope_of(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Scope:
        """The tenants the caller may touch (:mod:`kvstore.tenants`): ALL when auth is
        off and for admin and node tokens; no tenant for a token the table does not
        know (one a reload removed after the interceptor let the call in). Read from
        the table of now: a SIGHUP reload counts from the next call."""
        if self.tokens is None:
            return ALL
        creds = self.tokens.credentials_of(bearer(metadata))
        return creds[1] if creds is not None else NO_TENANT


@dataclass(frozen=True, slots=True)
class ClientCredentials:
    """What a client presents: a token, and TLS files (its CA, its own cert for mTLS)."""

    token: str | None = None
    tls: TlsFiles | None = field(default=None, repr=False)

    @staticmethod
    def resolve(token: str | None = None, token_file: str | None = None,
                tls: TlsFiles | None = None) -> "ClientCredentials":
        """Explicit values, else ``$KVSTORE_TOKEN`` / ``$KVSTORE_TOKEN_FILE`` / ``$KVSTORE_TLS_*``.

        Raises:
            OSError: a token file that cannot be read.
        """
        return ClientCredentials(client_token(token, token_file), tls or TlsFiles.client_from_env())

    def __repr__(self) -> str:            # never print a token
        return f"ClientCredentials(token={'***' if self.token else None}, tls={bool(self.tls)})"


# ---- servers ----

class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call's token and role against a service's method table.

    Args:
        security: the server's token file (must be set).
        methods: method name -> the roles that may call it.
    """

    def __init__(self, security: ServerSecurity, methods: MethodRoles):
        self.security = security
        self.methods = methods

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        role = self.security.role_of(details.invocation_metadata)
        method = details.method.rsplit("/", 1)[-1]
        if role is None:
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                            "missing or unknown credentials (authorization: Bearer TOKEN)")
        if not allows(role, self.methods.get(method, frozenset())):
            return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED,
                            f"role {role.value!r} may not call {method}")
        return handler


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode,
             message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that fails the call with ``code``."""
    async def unary(request, context):
        await context.abort(code, message)

    async def stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover  (makes this an async generator)

    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(stream, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class _Undecodable:
    """What a guarded deserializer hands on for bytes that are not a request."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


class TypedErrors(grpc.aio.ServerInterceptor):
    """Typed statuses for bad input (put it last: it wraps the servicer's own handler).

    Without it grpc.aio answers UNKNOWN ("Unexpected <DecodeError>") to bytes
    that do not parse and to any exception a handler lets out, and logs a
    traceback per call; the SDK would even retry UNKNOWN as a transport
    failure. Here undecodable bytes are INVALID_ARGUMENT ("the request cannot
    be parsed") and a :class:`KVStoreError` gets :func:`kvstore.errors.status_code`.
    Other exceptions stay what they are: bugs (UNKNOWN, logged). The
    deserializer is wrapped, so an interceptor that refuses the call first
    (:class:`AuthInterceptor`) still answers UNAUTHENTICATED to garbage.
    """

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler                  # no stream-in methods in kvstore's services
        decode = handler.request_deserializer

        def deserialize(raw: bytes):
            try:
                return decode(raw) if decode is not None else raw
            except Exception as exc:        # DecodeError and kin: the caller's bytes
                return _Undecodable(exc)

        kw = dict(request_deserializer=deserialize,
                  response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                await _refuse_undecodable(request, context)
                try:
                    reply = inner(request, context)
                    return await reply if inspect.isawaitable(reply) else reply
                except KVStoreError as err:
                    await abort(context, err)

            return grpc.unary_unary_rpc_method_handler(unary, **kw)
        inner_stream = handler.unary_stream
        if inspect.isasyncgenfunction(getattr(inner_stream, "__func__", inner_stream)):
            async def stream(request, context):
                await _refuse_undecodable(request, context)
                try:
                    async for item in inner_stream(request, context):
                        yield item
                except KVStoreError as err:
                    await abort(context, err)
        else:
            async def stream(request, context):       # a coroutine writing with context.write
                await _refuse_undecodable(request, context)
                try:
                    await inner_stream(request, context)
                except KVStoreError as err:
                    await abort(context, err)
        return grpc.unary_stream_rpc_method_handler(stream, **kw)


async def abort(context, err: KVStoreError):
    """Fail the call a grpc.aio servicer handles with ``err``: its gRPC status (the
    one table), its message, and its ``ErrorDetail`` in the trailing metadata, so
    the caller's :func:`kvstore.errors.from_rpc_error` raises the same class with
    the same fields. Never returns (grpc raises to end the handler)."""
    await context.abort(status_code(err), err.message, trailing_metadata=error_detail(err))


async def _refuse_undecodable(request, context) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request cannot be parsed: {str(request.error)[:200]}")


def aio_server(security: ServerSecurity | None = None,
               methods: MethodRoles | None = None, metrics=None) -> grpc.aio.Server:
    """A grpc.aio server with kvstore's options; with a token file, every call is checked
    against ``methods`` (add ports with :func:`listen`, servicers, then start); with
    ``metrics`` (a :class:`kvstore.metrics.ProcessMetrics`) every call is counted and timed."""
    interceptors = []
    if metrics is not None:
        from kvstore.metrics import RequestMetrics

        interceptors.append(RequestMetrics(metrics))
    if security is not None and security.tokens is not None:
        interceptors.append(AuthInterceptor(security, methods or {}))
    interceptors.append(TypedErrors())
    return grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)


def listen(server: grpc.aio.Server, host: str, port: int,
           security: ServerSecurity | None = None) -> int:
    """Add a port to ``server`` (TLS when ``security`` has files); returns the port bound
    (``port`` 0: a free one).

    Raises:
        OSError: the address cannot be bound (taken, or not an address of this host).
    """
    where = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        if security is not None and security.tls is not None:
            return server.add_secure_port(where, grpc_server_credentials(security.tls))
        return server.add_insecure_port(where)
    except RuntimeError as exc:        # grpc's way of saying the address is taken
        raise OSError(f"cannot listen on {host}:{port}: {exc}") from None


def caller_role(context, security: ServerSecurity | None) -> Role | None:
    """The role of a call a servicer handles (admin when auth is off)."""
    if security is None:
        return Role.ADMIN
    return security.role_of(context.invocation_metadata())


def caller_scope(context, security: ServerSecurity | None) -> Scope:
    """The tenants a call a servicer handles may touch (ALL when auth is off: no
    token is looked at, nothing is parsed)."""
    if security is None or security.tokens is None:
        return ALL
    return security.scope_of(context.invocation_metadata())


# ---- channels ----

class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class _SyncDetails(_Details, grpc.ClientCallDetails):
    pass


class _BearerInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                         grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer TOKEN`` to every call of a blocking channel."""

    def __init__(self, token: str):
        self._entry = ("authorization", f"Bearer {token}")

    def _details(self, d) -> _SyncDetails:
        return _SyncDetails(d.method, d.timeout, list(d.metadata or ()) + [self._entry],
                            d.credentials, getattr(d, "wait_for_ready", None),
                            getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


class _AioBearer:
    """Adds ``authorization: Bearer TOKEN`` to the calls of an asyncio channel.

    grpc.aio files each interceptor under the first call kind it implements,
    so each kind gets a class of its own (:func:`_aio_bearers`).
    """

    def __init__(self, token: str):
        self._entry = ("authorization", f"Bearer {token}")

    def _details(self, d) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(d.metadata or ()), self._entry)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials,
                                          d.wait_for_ready)


class _AioBearerUnary(_AioBearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _AioBearerStream(_AioBearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


def _aio_bearers(token: str) -> list:
    return [_AioBearerUnary(token), _AioBearerStream(token)]


def channel(address: str, creds: ClientCredentials | None = None) -> grpc.Channel:
    """A blocking channel to ``address`` (host:port), with ``creds`` when given.

    Raises:
        InvalidArgument: ``address`` is not HOST:PORT (``binding.split_address``).
    """
    split_address(address)
    tls = creds.tls if creds is not None else None
    ch = (grpc.secure_channel(address, grpc_channel_credentials(tls), options=CHANNEL_OPTIONS)
          if tls is not None else grpc.insecure_channel(address, options=CHANNEL_OPTIONS))
    if creds is not None and creds.token:
        ch = grpc.intercept_channel(ch, _BearerInterceptor(creds.token))
    return ch


def aio_channel(address: str, creds: ClientCredentials | None = None) -> grpc.aio.Channel:
    """An asyncio channel to ``address`` (host:port), with ``creds`` when given.

    Raises:
        InvalidArgument: ``address`` is not HOST:PORT (``binding.split_address``).
    """
    split_address(address)
    tls = creds.tls if creds is not None else None
    interceptors = _aio_bearers(creds.token) if creds is not None and creds.token else None
    if tls is not None:
        return grpc.aio.secure_channel(address, grpc_channel_credentials(tls),
                                       options=CHANNEL_OPTIONS, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
