"""The transports a state transfer's bytes go over, under one interface (``_base``): the protocol above them
(``_link``) is written once.

::

    _base      Transport, Wire   the interface
    _pick      make              a transport by name ("gloo", "nixl", "mooncake"), or a typed error
    _gloo      GlooTransport     a fresh two-rank gloo pair per peer, replaced after a failure (the sender pushes)
    _nixl      NixlTransport     a NIXL agent (UCX), memory registered once, the receiver reads (pulls)
    _mooncake  MooncakeTransport Mooncake's Transfer Engine (TCP, P2P handshake), the receiver reads (pulls)
"""
