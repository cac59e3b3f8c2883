"""The client core: every decision of the SDKs, with no I/O in it.

Both SDKs (:class:`~kvstore.client.client.KVClient`, blocking sockets and gRPC;
:class:`~kvstore.client.aio.AsyncKVClient`, asyncio and ``grpc.aio``) are
drivers: they perform what these modules decide, and decide nothing
themselves. One concept per module:

    replies    the node's answer (one :class:`Reply` type) and the master's
               replies decoded into kvstore records, once
    failover   which master a call goes to next, after what pause, when it gives up
    routing    keys by shard, and the one WRONG_SHARD refresh of the shard map
    reads      the replica order, fallback across replicas, the stale-cache retry
    placement  grants: an object id and target nodes (same host first) per value
    puts       a value's put as a state machine whose steps are :class:`Step` values
    framing    the pipelined connection's frames: requests out, answers in

Nothing here opens a socket, sleeps or reads a clock it was not handed
(except :func:`time.monotonic` defaults), so tests drive it without a network.
"""
