"""kvstore: a distributed KVCache store for disaggregated LLM serving.

Architecture after Mooncake (FAST'25, arXiv 2407.00079): a sharded metadata
master (control plane, gRPC) and store nodes that own KV block memory (data
plane: TCP frames and same-host shared memory).
"""

__version__ = "0.1.0"
