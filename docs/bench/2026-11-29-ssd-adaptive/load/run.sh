#!/bin/bash
# SSD under the adaptive policy at 2 and 4 sessions (2e1b505), torch paged; the guard learns each level in the default cell first.
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=/work/ssd1/out6
mkdir -p $OUT
.venv/bin/specdec up --draft-model $M/qwen2.5-coder-0.5b-instruct/model \
    --target-model $M/qwen2.5-coder-1.5b-instruct/model --port 50561 --http-port 0 \
    --gateway-arg '--suffix-cache-scope off' --drafter-arg '--engine paged' --verifier-arg '--engine paged' \
    --log-dir $OUT/logs > $OUT/up.out 2>&1 &
UP=$!
for t in $(seq 1 120); do grep -q "^ready" $OUT/up.out && break; sleep 5; done
D=sdk/specdec/sdk/loadtest/prompts.jsonl
load() { label=$1 modes=$2 c=$3 n=$4
  .venv/bin/specdec loadtest --gateway 127.0.0.1:50561 --concurrency $c --modes $modes \
    --prompts $D --num-requests $n --max-new-tokens 32 --output-len-range 0.5 --no-progress \
    --out $OUT/$label > $OUT/$label.log 2>&1
  echo "$(date +%T) done $label"; }
load c2 k0,default,adaptive 2 24
load c4 k0,default,adaptive 4 48
kill $UP; wait $UP
echo "$(date +%T) all done"
