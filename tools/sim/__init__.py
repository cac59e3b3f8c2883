"""The simulators: the conductor's real scheduler and the store's real eviction code, run
on a clock instead of a cluster.

:mod:`.simulate` is the discrete-event simulation of a Mooncake cluster (``kvstore simulate``)
on the simulated parts of :mod:`.cluster` (prefill KVCache pools, decode batches);
:mod:`.beyond` compares what goes beyond the paper (lookahead prefetch, hot-spot
replication; ``kvstore simulate-beyond``); :mod:`.demo` holds the simulator against a live
``kvstore demo`` run and :mod:`.parity` recomputes a live conductor's decisions
(``kvstore simulate-demo``, ``simulate-parity``); :mod:`.cache` replays trace hash_ids
through the nodes' eviction policies and Belady's optimum (``kvstore simulate-cache``).
"""
