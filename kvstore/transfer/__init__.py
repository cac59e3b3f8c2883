"""Data-plane transports: TCP frames and same-host shared memory (RDMA later)."""
