"""The tiers on top of the core: a host pool for offloaded states, and the prefix-state cache."""
