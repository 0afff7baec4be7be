"""``python -m metaseq_oneload``: the same as the ``metaseq-oneload`` command."""

import sys

from .cli import main

sys.exit(main())
