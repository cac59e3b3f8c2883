"""kvstore inside vLLM: the v1 KV connector and what it is made of.

:mod:`.connector` is ``KVStoreConnector``, the class vLLM loads out of tree
(``kvstore vllm-config`` prints the ``kv_transfer_config`` that names it); it
imports vLLM. :mod:`.keys` gives a block its key from everything that decides
its bytes and builds that config, with no vLLM import (the CLI and tests use it
without vLLM installed); :mod:`.staging` copies KV blocks between vLLM's paged
tensors and reusable host buffers. This package imports none of them itself.
"""
