#!/bin/bash
# Issue 45, twenty-third sitting (an experiment, never committed: experiment.diff): every epoch plain on llama.cpp
# at 2 sessions, on c4b3ee8 (a session alone only once the load has gone), the drafter fed in plain rounds
# (SPECDEC_FEED_LAG 16, the default) or never (1000000), ABBA; cells labelled by their order.
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=/work/exp18/out
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
n_cell=0
for v in 16 1000000 1000000 16; do
  n_cell=$((n_cell + 1))
  SPECDEC_GUARD_FORCE=plain SPECDEC_FEED_LAG=$v up lag$v-c$n_cell
  load lag$v-c$n_cell-mid-2 $D 2 48 k0,default
  kill $UP; wait $UP
done
echo "$(date +%T) all done"
