#!/usr/bin/env bash
# The goodput guard over several gateway replicas, simulated (simulated time: the figures
# do not depend on the machine; seeded, so they repeat exactly). From the repository root.
set -euo pipefail
out=docs/bench/2026-11-29-shared-guard
python -m specdec.tools.bench.loadsim --guard-replicas 32 --unpriced 0.3 > $out/sim-32-unpriced-0.3.md
python -m specdec.tools.bench.loadsim --guard-replicas 16 --unpriced 0.5 > $out/sim-16-unpriced-0.5.md
python -m specdec.tools.bench.loadsim --guard-replicas 8 --unpriced 0.0 > $out/sim-8-unpriced-0.md
