#!/bin/bash
# Issue 45, twenty-fourth sitting: the twenty-first sitting's cells twice on one stack per engine (pass a: the guard fresh; pass b: after it learnt every level in pass a), at cd33509; torch paged, then llama.cpp (the defaults), requests of 16 to 48 tokens (--output-len-range 0.5), the cross-request cache off.
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=${OUT:-/work/sweep17/out}
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
for pass in a b; do
  [ $pass = a ] && load torch-$pass-1 $D 1 12 k0,default
  load torch-$pass-2 $D 2 24 k0,default
  load torch-$pass-4 $D 4 48 k0,default
  load torch-$pass-8 $D 8 96 k0,default
done
kill $UP; wait $UP
up llamacpp
for pass in a b; do
  [ $pass = a ] && load llamacpp-$pass-1 $D 1 16 k0,default
  load llamacpp-$pass-2 $D 2 32 k0,default
  load llamacpp-$pass-4 $D 4 64 k0,default
  load llamacpp-$pass-8 $D 8 96 k0,default
done
kill $UP; wait $UP
echo "$(date +%T) all done"
