"""Fault injection: real clusters under inputs and failures they must survive, with what
broke counted.

:mod:`.fuzz` is ``kvstore fuzz`` (seeded fuzzing of the data port, the master's gRPC, the
HTTP and RESP fronts, with the processes, reads and memory checked after every batch);
:mod:`.partition` is ``kvstore partition`` (real links cut between network-namespace hosts
under load); :mod:`.chaos` is ``kvstore chaos`` (kill -9 of a node and a shard leader on a
fresh local cluster, counting lost puts, wrong reads and recovery times).
"""
