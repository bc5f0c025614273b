#!/bin/bash
# Two gateways over one stack and one Redis, 4 load-test users each: does the leader's
# guard count the follower's requests? (A functional check through the stack, one run.)
# From the repository root, with `make models` done.
set -u
M=~/.cache/specdec/models
OUT=${OUT:-/tmp/two-gateways}
mkdir -p $OUT
.venv/bin/specdec up --draft-model $M/qwen2.5-coder-0.5b-instruct/model \
  --target-model $M/qwen2.5-coder-1.5b-instruct/model --port 50561 --http-port 0 \
  --gateway-arg '--suffix-cache-scope off --metrics-port 9471' --drafter-arg '--engine paged' --verifier-arg '--engine paged' \
  --log-dir $OUT/logs > $OUT/up.out 2>&1 &
UP=$!
for i in $(seq 1 120); do grep -q "^ready" $OUT/up.out && break; sleep 5; done
R=$(awk '/^redis/{print $2}' $OUT/up.out); D=$(awk '/^drafter /{print $2}' $OUT/up.out); V=$(awk '/^verifier /{print $2}' $OUT/up.out)
# The second gateway: the same replicas, the same Redis.
.venv/bin/specdec serve gateway --host 127.0.0.1 --port 50562 --http-port 0 --drafter $D --verifier $V --redis $R \
  --suffix-cache-scope off --metrics-port 9472 > $OUT/gateway-b.log 2>&1 &
B=$!
sleep 20
LOADS=()
for g in 50561 50562; do
  .venv/bin/specdec loadtest --gateway 127.0.0.1:$g --concurrency 4 --modes default \
    --prompts sdk/specdec/sdk/loadtest/prompts.jsonl --num-requests 24 --max-new-tokens 32 --output-len-range 0.5 --no-progress \
    --out $OUT/load-$g > $OUT/load-$g.log 2>&1 &
  LOADS+=($!)
done
wait "${LOADS[@]}"
grep -h "shared goodput guard\|goodput guard epoch" $OUT/logs/gateway.log > $OUT/guard-a.jsonl
grep -h "shared goodput guard\|goodput guard epoch" $OUT/gateway-b.log > $OUT/guard-b.jsonl
for p in 9471 9472; do curl -s localhost:$p/metrics | grep -E "^specdec_gateway_guard_(role|event_delay)" > $OUT/metrics-$p.txt; done
kill $B; kill -INT $UP; wait
