"""The tiers on top of the core: where slot states are kept beside the pool's live slots.

::

    _hostpool  HostPool     host copies of slots (offload, restore, preemption by swap), pinned where it helps
    _hosttier  HostTier     a manager's host tier: offloads, restores and drops, checked and queued in one hold
    _prefix    PrefixCache  prefix checkpoints at any length in the pool, LRU leaves, evicted to the host tier
    _trie      Trie         the prefix cache's token trie

The host pool and the host tier are parts a manager holds (``_manager.py``); the prefix cache drives a
manager through its public methods.
"""
