#!/bin/bash
# The middle tree: late Speculates measured by the next Draft, but the 1.25 V floor still added beside each measurement (no pause on saving nothing, no SsdPrior).
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=/work/ssd1/out4
mkdir -p $OUT
.venv/bin/specdec up --draft-model $M/qwen2.5-coder-0.5b-instruct/model \
    --target-model $M/qwen2.5-coder-1.5b-instruct/model --port 50561 --http-port 0 \
    --gateway-arg '--suffix-cache-scope off' --drafter-arg '--engine paged' --verifier-arg '--engine paged' \
    --log-dir $OUT/logs > $OUT/up.out 2>&1 &
UP=$!
for t in $(seq 1 120); do grep -q "^ready" $OUT/up.out && break; sleep 5; done
D=sdk/specdec/sdk/loadtest/prompts.jsonl
load() { label=$1 modes=$2
  .venv/bin/specdec loadtest --gateway 127.0.0.1:50561 --concurrency 1 --modes $modes \
    --prompts $D --num-requests 16 --max-new-tokens 32 --output-len-range 0.5 --no-progress \
    --out $OUT/$label > $OUT/$label.log 2>&1
  echo "$(date +%T) done $label"; }
load a k0,default,adaptive,ssd2
load b adaptive,default
kill $UP; wait $UP
echo "$(date +%T) all done"
