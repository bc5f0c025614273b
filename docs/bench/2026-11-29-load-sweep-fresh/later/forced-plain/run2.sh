#!/bin/bash
# forced plain from the first epoch (no spec epoch to desynchronise the sessions)
set -u
cd /work/main
source <(sed -n '/^M=/,/^stop()/p' /work/feedab/run.sh)
export SPECDEC_GUARD_FORCE=plain SPECDEC_FEED_LAG=1000000
up plain0; load plain0 default; load plain0-k0 k0; stop
echo "$(date +%T) all done"
