"""Storage tiers of a store node behind one interface (``base.Tier``): DRAM, GPU, SSD."""
