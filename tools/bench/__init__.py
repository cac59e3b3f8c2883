"""``kvstore bench``: the data plane beside its limits and its peers, in one run.

One row per measurement (``--json`` prints them as a JSON array)::

    system    path        op         what is timed
    memcpy    cold        get        numpy copy between buffers larger than the LLC
    socket    reqresp     get, put   one small request, one value back (or in), per round trip
    socket    stream      get, put   values back to back on one connection (a second process)
    redis     tcp         get, put   redis-py GET / SET on a redis-server started here
    mooncake  tcp         get, put   Mooncake Store across processes over its TCP transport
                                     (when installed; see mooncake_peer)
    kvstore   shm         get, put   KVClient through the node's shared-memory segment
    kvstore   tcp         get, put   KVClient over TCP, one key per call
    kvstore   tcp-batch   get, put   batch_get_into / batch_put of 32 keys over TCP
    kvstore   concurrent  get, put   4 client processes at once (TCP unless --concurrent-shm)
    kvstore   tcp         exists     batch_exists of 1000 keys; ops/s counts keys, size is 0
    kvstore   tcp+tls     get, put   with --tls: tcp and tcp-batch again, over mutual TLS,
              tcp-batch+tls          against a second cluster that checks tokens (--auth)

Everything runs on this host against a cluster (master + one node) that the
benchmark starts and stops (``--tls``: a second one, with throwaway
certificates and tokens, whose rows the report sets beside their plain twins
as a ``tls/plain`` ratio). Gets land in preallocated buffers (``get_into``).

Cold memory: every measurement rotates through source and destination pools
of at least twice the last-level cache, so no value is cached when it is
touched, as for a real KV cache: the memcpy limit, the socket peer and the
node's working set (one per size) all follow this rule.

Timing: a warm-up of ``warmup_s``, then a budget of ``duration_s`` in
``rounds`` rounds, of which the median is reported (concurrent rows: one
round, from the first client's start to the last one's end). The memcpy
limit's rounds take turns with the shm gets' rounds, so that ratio compares
the two under the same state of the machine. Puts also stop
at ``max_put_bytes`` so the node never fills; their keys are removed
afterwards. GB/s is 10^9 bytes per second.

CPU: each row also gives the CPU time of each process behind it, read when
its timed rounds begin and end (:mod:`.cpu`: the kernel's per-process CPU
clock, the counter behind /proc/PID/stat's utime + stime, in ns), in µs per
value and per GiB moved: ``cpu_us_per_op`` and ``cpu_us_per_gib``, dicts of
process name (node, master, client, redis-server, holder, ...) -> µs. CPU
time is stable where wall time on a shared host is not, and it says which
process an operation costs.

Modules: :mod:`.harness` (rows, timing, cold pools, the run), one per system
(:mod:`.memcpy`, :mod:`.socket_peer`, :mod:`.redis_peer`, :mod:`.mooncake_peer`,
:mod:`.kvstore_peer`, :mod:`.kvstore_tls_peer`), :mod:`.cpu` (CPU time per
process), :mod:`.report` (targets,
tables) and :mod:`.command` (the CLI, and the systems in run order). System
modules import the harness; the harness imports none of them.
"""
