"""``python -m hixl`` is the ``hixl`` command (``python -m hixl bench --quick --check``)."""

import sys

from .cli import main

sys.exit(main())
