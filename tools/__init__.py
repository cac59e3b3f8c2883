"""Every entry point of kvstore and the tools around the product, in rooms by job.

    cli/       the command lines: ``kvstore`` (cli), ``kvctl`` (with ``top``), the services'
               command lines that launchers spawn (services, service_options), ``kvstore profile``
    cluster/   clusters on this machine: the launcher and its child processes, test
               certificates, network-namespace hosts (netns, multihost), the vLLM venv builder
    sim/       the simulators: scheduling (simulate, beyond, parity, demo), cache policies (cache)
    bench/     ``kvstore bench`` and ``kvstore scale``: the data plane against its peers
    faults/    fault injection: ``kvstore fuzz``, ``kvstore partition``, ``kvstore chaos``
    demo/      ``kvstore demo`` and ``kvstore replay``: the bundled traces replayed, their reports
    data/      the bundled traces (package data, no code)

Nothing below kvstore.tools imports it: it is the top layer (pyproject's import contract).
"""
