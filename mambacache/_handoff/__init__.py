"""The hand-off layer, above the core: a slot's state leaving for another engine or arriving from one.

The book and the arrivals are the manager's (it holds a book, the queue's guard); the transfer, its links,
the re-slicing and the transports drive a manager from outside (``_manager.CacheManager``).

::

    _book      HandOffBook    every sender's hand-off transition, under the queue's lock; the queue's SubmitGuard
    _arrivals  Arrivals       every receiver's: landing (in staging or in place), expecting, importing
    _transfer  StateTransfer  exported states to a peer, imported ones from it, over torch.distributed
    _link      Outbox, Inbox  one direction of a transfer: control through the group's store, bytes over gloo
    _reslice   StateLayout    re-slicing states between tensor-parallel sizes (ReslicingSender, -Receiver)

The core never imports this folder (``tests/package/test_layers.py``): the queue asks
the book through the ``SubmitGuard`` protocol it defines itself, and the
manager (``_manager.py``), which holds the book beside the core's parts, stands
between the book and the transfer. Nothing is imported on import of the folder
itself: each module imports what it uses.
"""
