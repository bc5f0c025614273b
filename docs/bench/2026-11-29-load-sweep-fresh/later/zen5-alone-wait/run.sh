#!/bin/bash
# Issue 45, twentieth sitting (an experiment, never committed: experiment.diff): every epoch plain on llama.cpp at
# 2 sessions, a session alone speculating at once (alone_rounds 0, as before) or after one mean round alone (1), ABBA.
# The labels: up()'s wait loop reused the counter i, so the cells were labelled by it and the
# second alone1 cell overwrote the first in out/; each cell was copied as it finished, in order,
# to alone0-a, alone1-b, alone1-c and alone0-d here.
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=/work/exp16/out
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
for v in 0 1 1 0; do
  i=$((${i:-0} + 1))
  SPECDEC_GUARD_FORCE=plain SPECDEC_GUARD_ALONE_ROUNDS=$v up alone$v-$i
  load alone$v-$i-mid-2 $D 2 48 k0,default
  kill $UP; wait $UP
done
echo "$(date +%T) all done"
