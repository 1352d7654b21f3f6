"""`python -m ess.cli`: the `ess` command."""

import sys

from ess.cli import main

sys.exit(main())
