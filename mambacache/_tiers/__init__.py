"""The tiers on top of the core: the prefix-state cache (its host tier is the core's HostPool)."""
