#!/bin/bash
# Issue 45, twenty-fifth sitting: an epoch of one session no longer sets the next to speculate.
# llama.cpp (the defaults), 2 sessions, 32 requests a cell (k0 then the default, 2 slices),
# four stacks in the order new, old, old, new; "old" is df8c79b's guard.py, "new" the working
# tree's (committed after the run). Requests of 16 to 48 tokens, the cross-request cache off.
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=${OUT:-/work/lull/out}
G=services/gateway/specdec/gateway/round/policy/guard.py
mkdir -p $OUT
echo "$(date +%T) start $(git rev-parse --short HEAD)"; lscpu | grep -E "Model name|^CPU\(s\)|^Model:|^CPU family"
i=0
for variant in new old old new; do
  i=$((i+1)); label=$i-$variant
  cp /work/lull/guard-$variant.py $G
  .venv/bin/specdec up --draft-model $M/qwen2.5-coder-0.5b-instruct/model \
    --target-model $M/qwen2.5-coder-1.5b-instruct/model --port 50561 --http-port 0 \
    --gateway-arg '--suffix-cache-scope off' \
    --log-dir $OUT/logs-$label > $OUT/up-$label.out 2>&1 &
  UP=$!
  for t in $(seq 1 120); do grep -q "^ready" $OUT/up-$label.out && break; sleep 5; done
  .venv/bin/specdec loadtest --gateway 127.0.0.1:50561 --concurrency 2 --modes k0,default \
    --prompts sdk/specdec/sdk/loadtest/prompts.jsonl --num-requests 32 --max-new-tokens 32 \
    --output-len-range 0.5 --no-progress --out $OUT/$label > $OUT/$label.log 2>&1
  echo "$(date +%T) done $label"
  kill $UP; wait $UP
done
cp /work/lull/guard-new.py $G
echo "$(date +%T) all done"
