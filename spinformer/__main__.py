"""`python -m spinformer ...` is the `spinformer` command."""

import sys

from .cli import main

sys.exit(main())
