"""Network partitions on a cluster across hosts (network namespaces): ``kvstore partition``."""
