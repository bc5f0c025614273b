#!/bin/bash
# Lockstep: the verifier's forwards under k0 (users in step) against plain steps after one
# speculating epoch (the guard forced plain after its first epoch; experiment env). 4 sessions.
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=/work/feedab/out3
mkdir -p $OUT
scrape() { curl -s localhost:9109/metrics | grep -E "^specdec_[a-z]*_?model_forward_(seconds|tokens|batch_size|sessions)_(sum|count)" > $OUT/$1.prom; }
.venv/bin/specdec up --draft-model $M/qwen2.5-coder-0.5b-instruct/model \
    --target-model $M/qwen2.5-coder-1.5b-instruct/model --port 50561 --http-port 0 \
    --gateway-arg '--suffix-cache-scope off' --drafter-arg '--engine paged' \
    --verifier-arg '--engine paged --metrics-port 9109' \
    --log-dir $OUT/logs > $OUT/up.out 2>&1 &
UP=$!
for i in $(seq 1 120); do grep -q "^ready" $OUT/up.out && break; sleep 5; done
load() {
  .venv/bin/specdec loadtest --gateway 127.0.0.1:50561 --concurrency 4 --modes $2 \
    --prompts sdk/specdec/sdk/loadtest/prompts.jsonl --num-requests 48 --max-new-tokens 32 \
    --no-progress --out $OUT/$1 > $OUT/$1.log 2>&1
  echo "$(date +%T) done $1"
}
scrape start; load k0 k0; scrape k0; load plain default; scrape plain
kill $UP; wait $UP
echo "$(date +%T) all done"
