"""``python -m gearcache``: the ``gearcache`` command (the same as ``python -m gearcache.cli``)."""
import sys

from .cli import main

sys.exit(main())
