#!/bin/bash
# Issue 45, tenth sitting: requests of 16 to 48 tokens (--output-len-range 0.5), the cache of
# recent outputs off, 242cc84. torch paged at 8 sessions for longer (160 requests a mode: the
# guard's time to learn), then llama.cpp (the defaults) at 2, 4, 8 sessions.
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=/work/sweep9/out
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
load() {  # $1 label $2 concurrency $3 requests $4 modes, rest: loadtest args
  label=$1 c=$2 n=$3 modes=$4; shift 4
  .venv/bin/specdec loadtest --gateway 127.0.0.1:50561 --concurrency $c --modes $modes \
    --prompts sdk/specdec/sdk/loadtest/prompts.jsonl --num-requests $n --max-new-tokens 32 \
    --output-len-range 0.5 --no-progress --out $OUT/$label "$@" > $OUT/$label.log 2>&1
  echo "$(date +%T) done $label"
}
stop() { kill $UP; wait $UP; sleep 5; }
echo "$(date +%T) start $(git -C /work/main rev-parse --short HEAD)"; lscpu | grep -E "Model name|^CPU\(s\)|^Model:|^CPU family"
up torch --drafter-arg '--engine paged' --verifier-arg '--engine paged'
load torch-long-8 8 160 k0,default --slices 1
stop
up llamacpp
load llamacpp-mid-2 2 24 k0,default
load llamacpp-mid-4 4 48 k0,default
load llamacpp-mid-8 8 64 k0,default
stop
echo "$(date +%T) all done"
