"""`python -m specdec.verifier`: the same as `specdec serve verifier`."""

import sys

from specdec.cli import main

sys.exit(main(["serve", "verifier", *sys.argv[1:]]))
