"""The command lines: where a command typed by a person or spawned by a launcher starts.

:mod:`.cli` is the ``kvstore`` command (its tools' commands registered only when needed),
:mod:`.kvctl` the ``kvctl`` administration command with :mod:`.top` (``kvctl top``),
:mod:`.services` the services' command lines (``kvstore master | node | ... | resp``, and
``python -m kvstore.tools.cli.services NAME`` that the launcher spawns) with the options they
share in :mod:`.service_options`, and :mod:`.profile` is ``kvstore profile`` (the cost model
fitted on this machine). The code these commands run lives in the other rooms and below.
"""
