#!/bin/bash
# Issue 45: the verifier's gathering wait, 1 ms (the old default) against 20 ms with the
# turnaround filter; torch paged, cross-request suffix cache off; k0 and default at 2, 4, 8.
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=/work/sweep5/gather
mkdir -p $OUT
up() {  # $1 label, rest: extra args
  label=$1; shift
  .venv/bin/specdec up --draft-model $M/qwen2.5-coder-0.5b-instruct/model \
    --target-model $M/qwen2.5-coder-1.5b-instruct/model --port 50561 --http-port 0 \
    --gateway-arg '--suffix-cache-scope off' --drafter-arg '--engine paged' \
    --log-dir $OUT/logs-$label "$@" > $OUT/up-$label.out 2>&1 &
  UP=$!
  for i in $(seq 1 120); do grep -q "^ready" $OUT/up-$label.out && break; sleep 5; done
  cat $OUT/up-$label.out
}
load() {  # $1 label $2 concurrency $3 requests
  .venv/bin/specdec loadtest --gateway 127.0.0.1:50561 --concurrency $2 --modes k0,default \
    --prompts sdk/specdec/sdk/loadtest/prompts.jsonl --num-requests $3 --max-new-tokens 32 \
    --no-progress --out $OUT/$1 > $OUT/$1.log 2>&1
  echo "$(date +%T) done $1"
}
stop() { kill $UP; wait $UP; sleep 5; }
echo "$(date +%T) start $(git -C /work/main rev-parse --short HEAD) + uncommitted"
for wait in 20 1; do
  up w$wait --verifier-arg "--engine paged --max-batch-wait-ms $wait"
  load w$wait-2 2 24
  load w$wait-4 4 32
  stop
done
# llama.cpp both replicas (the defaults on this CPU): k0 and default at 2 and 4
for wait in 20 1; do
  .venv/bin/specdec up --draft-model $M/qwen2.5-coder-0.5b-instruct/model \
    --target-model $M/qwen2.5-coder-1.5b-instruct/model --port 50561 --http-port 0 \
    --gateway-arg '--suffix-cache-scope off' --verifier-arg "--max-batch-wait-ms $wait" \
    --log-dir $OUT/logs-llama-w$wait > $OUT/up-llama-w$wait.out 2>&1 &
  UP=$!
  for i in $(seq 1 120); do grep -q "^ready" $OUT/up-llama-w$wait.out && break; sleep 5; done
  load llama-w$wait-4 4 32
  stop
done
echo "$(date +%T) all done"
