#!/bin/bash
# One gateway, 8 load-test users, on the same stack as two-gateways/: the guard's epochs and
# their level, for comparison. From the repository root, with `make models` done.
set -u
M=~/.cache/specdec/models
OUT=${OUT:-/tmp/one-gateway}
mkdir -p $OUT
.venv/bin/specdec up --draft-model $M/qwen2.5-coder-0.5b-instruct/model \
  --target-model $M/qwen2.5-coder-1.5b-instruct/model --port 50561 --http-port 0 \
  --gateway-arg '--suffix-cache-scope off' --drafter-arg '--engine paged' --verifier-arg '--engine paged' \
  --log-dir $OUT/logs > $OUT/up.out 2>&1 &
UP=$!
for i in $(seq 1 120); do grep -q "^ready" $OUT/up.out && break; sleep 5; done
sleep 20
.venv/bin/specdec loadtest --gateway 127.0.0.1:50561 --concurrency 8 --modes default \
  --prompts sdk/specdec/sdk/loadtest/prompts.jsonl --num-requests 48 --max-new-tokens 32 --output-len-range 0.5 --no-progress \
  --out $OUT/load > $OUT/load.log 2>&1
grep -h "shared goodput guard\|goodput guard epoch" $OUT/logs/gateway.log > $OUT/guard.jsonl
kill -INT $UP; wait
