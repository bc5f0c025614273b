#!/bin/bash
# Before (3a83c23), one stack: 1 session, then fixed lengths (run2.sh) and SSD (run3.sh) on the same stack.
# The 2- and 4-session cells this script goes on to were stopped (not committed).
# 12de589 (the guard: a session alone only after a mean round alone); the cross-request cache off.
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=/work/ssd1/out
up() {  # $1 label, rest: extra args
  label=$1; shift
  .venv/bin/specdec up --draft-model $M/qwen2.5-coder-0.5b-instruct/model \
    --target-model $M/qwen2.5-coder-1.5b-instruct/model --port 50561 --http-port 0 \
    --gateway-arg '--suffix-cache-scope off' \
    --log-dir $OUT/logs-$label "$@" > $OUT/up-$label.out 2>&1 &
  UP=$!
  for i in $(seq 1 120); do grep -q "^ready" $OUT/up-$label.out && break; sleep 5; done
  cat $OUT/up-$label.out
}
load() {  # $1 label $2 prompts $3 concurrency $4 requests $5 modes, rest: loadtest args
  label=$1 prompts=$2 c=$3 n=$4 modes=$5; shift 5
  .venv/bin/specdec loadtest --gateway 127.0.0.1:50561 --concurrency $c --modes $modes \
    --prompts $prompts --num-requests $n --max-new-tokens 32 --output-len-range 0.5 --no-progress \
    --out $OUT/$label "$@" > $OUT/$label.log 2>&1
  echo "$(date +%T) done $label"
}
D=sdk/specdec/sdk/loadtest/prompts.jsonl
G=sdk/specdec/sdk/loadtest/prompts-grounded.jsonl
echo "$(date +%T) start $(git -C /work/main rev-parse --short HEAD)"; lscpu | grep -E "Model name|^CPU\(s\)|^Model:|^CPU family"
up torch --drafter-arg '--engine paged' --verifier-arg '--engine paged'
load torch-1 $D 1 16 k0,default,adaptive
load torch-2 $D 2 24 k0,default,adaptive
load torch-4 $D 4 48 k0,default,adaptive
kill $UP; wait $UP
echo "$(date +%T) all done"
