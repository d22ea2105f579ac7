"""``python -m service.cli``: the same as the ``edge-un`` console script."""

import sys

from . import main

sys.exit(main())
