#!/bin/bash
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=/work/diag45/$1; shift
mkdir -p $OUT
.venv/bin/specdec up --draft-model $M/qwen2.5-coder-0.5b-instruct/model \
    --target-model $M/qwen2.5-coder-1.5b-instruct/model --port 50561 --http-port 0 \
    --log-dir $OUT/logs "$@" > $OUT/up.out 2>&1 &
UP=$!
for i in $(seq 1 120); do grep -q "^ready" $OUT/up.out && break; sleep 5; done
V=$(grep '^verifier' $OUT/up.out | awk '{print $2}'); D=$(grep '^drafter' $OUT/up.out | awk '{print $2}')
.venv/bin/python docs/bench/2026-11-28-load-sweep/diag-16/poll.py $V $D $OUT/poll.jsonl &
P=$!
echo "$(date +%T) up"
.venv/bin/specdec loadtest --gateway 127.0.0.1:50561 --concurrency 16 --modes k0,default \
    --num-requests 32 --max-new-tokens 32 --slices 2 --no-progress --out $OUT/lt > $OUT/lt.log 2>&1
echo "$(date +%T) done"
curl -s http://127.0.0.1:9109/metrics > $OUT/metrics.txt
kill $P; kill $UP; wait $UP
