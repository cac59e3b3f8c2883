"""The demo and trace replay: the bundled Mooncake traces through a real cluster.

:mod:`.run` is ``kvstore demo`` (an embedded local cluster replaying a trace with the
prefix cache and without it), made of :mod:`.window` (which part of the trace is measured),
:mod:`.warmup` (the requests before it that fill the store), :mod:`.arrivals` (the rate the
bundled engines can serve) and :mod:`.compare` (the two runs side by side); :mod:`.replay`
is ``kvstore replay`` against a running conductor; :mod:`.trace` loads the traces (in
``tools/data``) and synthesizes their tokens; :mod:`.report` holds the per-request results,
the summary and its tables.
"""
