"""The Redis protocol front: ``kvstore resp`` serves RESP2 / RESP3 over the SDK.

    protocol.py   the bounded command reader and the reply encoder (pure)
    table.py      the command table, dispatch, roles, the store-error map
    data.py       string verbs (GET, SET, MGET, MSET, EXISTS, DEL, ...)
    verbs.py      connection and server verbs (HELLO, AUTH, INFO, SCAN, ...)
    info.py       INFO sections and CONFIG GET values
    server.py     the listener: a thread per connection, READY, signals

It is a client of the store, an adapter for Redis clients (redis-cli, redis-py,
LMCache's redis:// connector): it imports the SDK and the core, never the
master's or the nodes' internals nor kvstore.tools (the import contract checks
it). Its command line (flags, checks, ``serve``'s call) is ``resp_main`` in
:mod:`kvstore.tools.cli.services`.
"""
