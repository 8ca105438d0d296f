"""``python -m kvpress`` = the ``kvpress`` command."""

import sys

from kvpress.cli import main

sys.exit(main())
