"""`python -m neuroshard.adversary`: the same as `neuroshard-adversary`."""

import sys

from .cli import main

sys.exit(main())
