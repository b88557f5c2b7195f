"""``python -m hixl.cli`` is the ``hixl`` command."""

import sys

from . import main

sys.exit(main())
