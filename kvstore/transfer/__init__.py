"""Data-plane transports behind one interface (``base.Transport``): TCP frames, same-host
shared memory, one-sided RDMA."""
