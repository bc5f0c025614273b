#!/bin/bash
# Issue 45: do plain epochs lose to k0 through the drafter's feed beside them? torch paged, 4
# sessions; the guard forced plain (experiment env), feed on (16) vs off; k0 in the first stack.
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=/work/feedab/out
mkdir -p $OUT
up() {
  label=$1; shift
  .venv/bin/specdec up --draft-model $M/qwen2.5-coder-0.5b-instruct/model \
    --target-model $M/qwen2.5-coder-1.5b-instruct/model --port 50561 --http-port 0 \
    --gateway-arg '--suffix-cache-scope off' --drafter-arg '--engine paged' --verifier-arg '--engine paged' \
    --log-dir $OUT/logs-$label > $OUT/up-$label.out 2>&1 &
  UP=$!
  for i in $(seq 1 120); do grep -q "^ready" $OUT/up-$label.out && break; sleep 5; done
}
load() {
  .venv/bin/specdec loadtest --gateway 127.0.0.1:50561 --concurrency 4 --modes $2 \
    --prompts sdk/specdec/sdk/loadtest/prompts.jsonl --num-requests 48 --max-new-tokens 32 \
    --no-progress --out $OUT/$1 > $OUT/$1.log 2>&1
  echo "$(date +%T) done $1"
}
stop() { kill $UP; wait $UP; sleep 5; }
echo "$(date +%T) start"
export SPECDEC_GUARD_FORCE=plain
export SPECDEC_FEED_LAG=16
up feed; load feed-k0 k0; load feed default; stop
export SPECDEC_FEED_LAG=1000000
up nofeed; load nofeed default; load nofeed-k0 k0; stop
echo "$(date +%T) all done"
