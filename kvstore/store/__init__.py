"""Store nodes: the data plane. Nodes own their memory and its placement."""
