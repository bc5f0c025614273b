#!/bin/bash
# Issue 45 diag: is the loss at 16 sessions the drafter's CPU? lookups-only adaptive vs default vs k0
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=/work/diag45/${1:-out}
mkdir -p $OUT
shift || true
.venv/bin/specdec up --draft-model $M/qwen2.5-coder-0.5b-instruct/model \
    --target-model $M/qwen2.5-coder-1.5b-instruct/model --port 50561 --http-port 0 \
    --log-dir $OUT/logs "$@" > $OUT/up.out 2>&1 &
UP=$!
for i in $(seq 1 120); do grep -q "^ready" $OUT/up.out && break; sleep 5; done
echo "$(date +%T) up"
.venv/bin/specdec loadtest --gateway 127.0.0.1:50561 --concurrency 16 --modes k0,default,adaptive@ngram,default@model \
    --num-requests 32 --max-new-tokens 32 --slices 2 --no-progress --out $OUT/lt > $OUT/lt.log 2>&1
echo "$(date +%T) done"
curl -s http://127.0.0.1:9109/metrics > $OUT/metrics.txt
kill $UP; wait $UP
