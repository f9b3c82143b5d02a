"""``python -m batcher`` is the ``batcher`` command."""

import sys

from .cli import main

sys.exit(main())
