"""``python -m fp8core``: the same as the ``fp8core`` command."""

import sys

from .cli import main

sys.exit(main())
