"""``kvstore fuzz``: seeded, reproducible fuzzing of every surface a client can reach.

    surface     generator (inputs)     driver (sending, reading)    what it talks to
    data-tcp    frames                 data_driver (+ framing)      node data port, TCP
    data-unix   frames                 data_driver (+ framing)      node's Unix socket
    master      grpc_inputs            grpc_driver                  master gRPC methods
    http        http_inputs            http_driver                  conductor HTTP front

:mod:`.runner` splits the inputs across the surfaces and runs them in
batches; after each, :mod:`.checks` checks that every process lives, that a
normal client reads its reference objects byte-exact, that each surface
still answers a well-formed request, and samples memory. :mod:`.cluster`
starts the cluster (``--auth`` on) or attaches to one, :mod:`.report` holds
the counts and the table, :mod:`.command` is the CLI. :mod:`.mutate` has the
mutation primitives the generators share. Generators never look at what the
servers answer, so a seed gives the same inputs on every run.
"""
