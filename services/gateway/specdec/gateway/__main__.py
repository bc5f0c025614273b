"""`python -m specdec.gateway`: the same as `specdec serve gateway`."""

import sys

from specdec.cli import main

sys.exit(main(["serve", "gateway", *sys.argv[1:]]))
