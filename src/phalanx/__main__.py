"""`python -m phalanx ...` is the same as the `phalanx` command."""

import sys

from .cli import main

sys.exit(main())
