"""Every entry point of kvstore: the ``kvstore`` and ``kvctl`` CLIs, the services' command
lines, the launcher, the demo, chaos, the benchmark, simulators and trace tools."""
