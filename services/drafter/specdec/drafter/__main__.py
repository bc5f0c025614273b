"""`python -m specdec.drafter`: the same as `specdec serve drafter`."""

import sys

from specdec.cli import main

sys.exit(main(["serve", "drafter", *sys.argv[1:]]))
