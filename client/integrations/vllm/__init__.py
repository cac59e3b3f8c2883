"""kvstore inside vLLM: the v1 KV connector and what it is made of.

:mod:`.connector` is ``KVStoreConnector``, the class vLLM loads out of tree
(``kvstore vllm-config`` prints the ``kv_transfer_config`` that names it); it
imports vLLM. :mod:`.keys` gives a block its key from everything that decides
its bytes and builds that config, with no vLLM import (the CLI and tests use it
without vLLM installed); :mod:`.staging` copies KV blocks between vLLM's paged
tensors and reusable host buffers; :mod:`.loads` reads a request's blocks (in
the background with ``load_async``) and :mod:`.layerwise` saves them layer by
layer through ``put_parts``; :mod:`.offload_tier` is a secondary tier of vLLM's
own OffloadingConnector (it imports vLLM). This package imports none of them itself.
"""
