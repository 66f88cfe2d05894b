import os as _os

if _os.environ.get("MAMBACACHE_TEST_TRANSPORT", "gloo") != "gloo":  # a rank spawned by a test over another transport
    from .support.link import TRANSPORT_ENV as _ENV
    from .support.link import default_transport as _default

    _default(_os.environ[_ENV])
