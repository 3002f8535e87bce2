"""``python -m gearcache.cli``: the ``gearcache`` command."""
import sys

from . import main

sys.exit(main())
