#!/bin/bash
# Issue 45, twenty-sixth sitting: torch paged, 4 sessions for about five minutes a mode (k0 then the default, 2 slices),
# at 8258d2a; requests of 16 to 48 tokens (--output-len-range 0.5), the cross-request cache off.
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=${OUT:-/work/long4/out}
mkdir -p $OUT
echo "$(date +%T) start $(git rev-parse --short HEAD)"; lscpu | grep -E "Model name|^CPU\(s\)|^Model:|^CPU family"
.venv/bin/specdec up --draft-model $M/qwen2.5-coder-0.5b-instruct/model \
  --target-model $M/qwen2.5-coder-1.5b-instruct/model --port 50561 --http-port 0 \
  --gateway-arg '--suffix-cache-scope off' \
  --drafter-arg '--engine paged' --verifier-arg '--engine paged' \
  --log-dir $OUT/logs > $OUT/up.out 2>&1 &
UP=$!
for t in $(seq 1 120); do grep -q "^ready" $OUT/up.out && break; sleep 5; done
.venv/bin/specdec loadtest --gateway 127.0.0.1:50561 --concurrency 4 --modes k0,default \
  --prompts sdk/specdec/sdk/loadtest/prompts.jsonl --num-requests 200 --max-new-tokens 32 \
  --output-len-range 0.5 --no-progress --out $OUT/torch-4 > $OUT/torch-4.log 2>&1
echo "$(date +%T) done torch-4"
kill $UP; wait $UP
echo "$(date +%T) all done"
