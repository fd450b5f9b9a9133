"""``python -m agl_core.cli``: the ``agl`` command."""

import sys

from agl_core.cli import main

sys.exit(main())
