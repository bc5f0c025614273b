#!/bin/bash
# Issue 45: the goodput guard with the drafter fed in plain epochs, through specdec up
# (torch paged, then llama.cpp) + loadtest: default set with fixed k, then grounded set.
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=/work/sweep4/high
mkdir -p $OUT
up() {  # $1 label, rest: extra args
  label=$1; shift
  .venv/bin/specdec up --draft-model $M/qwen2.5-coder-0.5b-instruct/model \
    --target-model $M/qwen2.5-coder-1.5b-instruct/model --port 50561 --http-port 0 \
    --log-dir $OUT/logs-$label "$@" > $OUT/up-$label.out 2>&1 &
  UP=$!
  for i in $(seq 1 120); do grep -q "^ready" $OUT/up-$label.out && break; sleep 5; done
  cat $OUT/up-$label.out
}
load() {  # $1 label $2 prompts $3 concurrency $4 requests $5 modes
  .venv/bin/specdec loadtest --gateway 127.0.0.1:50561 --concurrency $3 --modes $5 \
    --prompts $2 --num-requests $4 --max-new-tokens 32 --no-progress --slices 1 \
    --out $OUT/$1 > $OUT/$1.log 2>&1
  echo "$(date +%T) done $1"
}
stop() { kill $UP; wait $UP; sleep 5; }
D=sdk/specdec/sdk/loadtest/prompts.jsonl
G=sdk/specdec/sdk/loadtest/prompts-grounded.jsonl
[ -n "${FIRST:-}" ] && while kill -0 "$FIRST" 2>/dev/null; do sleep 5; done  # run.sh, if still running
echo "$(date +%T) start $(git -C /work/main rev-parse --short HEAD)"; lscpu | grep -E "Model name|^CPU\(s\)|^Model:|^CPU family"
up torch --drafter-arg '--engine paged' --verifier-arg '--engine paged'
load torch-high $D 16,32 64 k0,default
load torch-grounded-high $G 16,32 32 k0,default
stop
up llamacpp
load llamacpp-high $D 16,32 64 k0,default
load llamacpp-grounded-high $G 16,32 32 k0,default
stop
echo "$(date +%T) all done"
