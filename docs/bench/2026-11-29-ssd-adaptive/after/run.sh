#!/bin/bash
# Issue 45: adaptive with SSD after the late-Speculate pricing, the pause on saving nothing and the gateway-wide SsdPrior (working tree on 3a83c23), torch paged, 1 session.
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=/work/ssd1/out5
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
load a k0,default,adaptive
load b adaptive,default
kill $UP; wait $UP
echo "$(date +%T) all done"
