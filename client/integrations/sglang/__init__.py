"""kvstore inside SGLang: the HiCache storage backend (SGLang's L3 tier) and what it is made of.

:mod:`.backend` is ``KVStoreHiCacheStorage``, the class SGLang loads with
``--hicache-storage-backend dynamic`` (its module doc gives the flags); it
imports SGLang and torch. :mod:`.keys` maps SGLang's page hashes into kvstore
namespaces with no SGLang or torch import; :mod:`.pool` gives zero-copy views
of the pages of SGLang's registered host pool. This package imports none of
them itself.
"""
