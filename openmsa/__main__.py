"""``python -m openmsa ...``: the ``openmsa`` command."""

import sys

from .cli import main

sys.exit(main())
