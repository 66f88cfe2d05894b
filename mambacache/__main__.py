"""``python -m mambacache``: the same as the ``mambacache`` command."""

import sys

from ._cli import main

sys.exit(main())
