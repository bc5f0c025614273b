#!/bin/bash
# Issue 45, sixth sitting: the gateway's cross-request suffix cache off (--suffix-cache-scope
# off), so a repeated prompt's later requests cannot copy an earlier request's output;
# the guard's fluid epochs. specdec up (torch paged, then llama.cpp) + loadtest.
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=/work/sweep5/out
mkdir -p $OUT
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
    --prompts $prompts --num-requests $n --max-new-tokens 32 --no-progress \
    --out $OUT/$label "$@" > $OUT/$label.log 2>&1
  echo "$(date +%T) done $label"
}
stop() { kill $UP; wait $UP; sleep 5; }
D=sdk/specdec/sdk/loadtest/prompts.jsonl
G=sdk/specdec/sdk/loadtest/prompts-grounded.jsonl
echo "$(date +%T) start $(git -C /work/main rev-parse --short HEAD)"; lscpu | grep -E "Model name|^CPU\(s\)|^Model:|^CPU family"
up torch --drafter-arg '--engine paged' --verifier-arg '--engine paged'
load torch-low $D 1,2,4,8 16 k0,default,k2,k4
load torch-high $D 16,32 64 k0,default,k2 --slices 1
load torch-grounded-low $G 1,2,4,8 16 k0,default
load torch-grounded-high $G 16,32 32 k0,default --slices 1
stop
up llamacpp
load llamacpp-low $D 1,2,4,8 16 k0,default,k2
load llamacpp-high $D 16,32 64 k0,default --slices 1
stop
echo "$(date +%T) all done"
