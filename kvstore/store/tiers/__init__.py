"""Storage tiers of a store node (GPU / DRAM / SSD)."""
