"""Clusters of real processes on this machine, for tests, ``kvstore up`` and the tools.

:mod:`.launcher` is the one launcher (master shards, nodes, engines, conductor, etcd) on
:mod:`.processes` (children started, waited on for READY, watched, stopped together);
:mod:`.certs` writes a test CA and certificates (``kvstore certs``); :mod:`.netns` makes
several hosts on one machine from network namespaces and :mod:`.multihost` lays a cluster
across them (``kvstore hosts``); :mod:`.vllm_env` and :mod:`.sglang_env` build the virtual
environments that run the vLLM connector and the SGLang backend (``python3
tools/cluster/vllm_env.py VENV``, standard library only), on the steps of :mod:`.venv_steps`.
"""
