#!/bin/bash
# CPU seconds of each process of the stack during a k0-only and a default-only load at 16 sessions
set -u
cd /work/main
M=~/.cache/specdec/models
OUT=/work/diag45/cpu; mkdir -p $OUT
.venv/bin/specdec up --draft-model $M/qwen2.5-coder-0.5b-instruct/model \
    --target-model $M/qwen2.5-coder-1.5b-instruct/model --port 50561 --http-port 0 \
    --log-dir $OUT/logs "$@" > $OUT/up.out 2>&1 &
UP=$!
for i in $(seq 1 120); do grep -q "^ready" $OUT/up.out && break; sleep 5; done
pids() { for p in $(pgrep -f "specdec serve|redis-server|specdec loadtest"); do echo "$p $(cat /proc/$p/stat | awk '{print $14+$15}') $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-60)"; done; }
for mode in k0 default k0 default; do
  .venv/bin/specdec loadtest --gateway 127.0.0.1:50561 --concurrency 16 --modes $mode \
    --num-requests 32 --max-new-tokens 32 --no-progress --out $OUT/lt-$mode > $OUT/lt-$mode.log 2>&1 &
  L=$!; sleep 1
  echo "== $mode start $(date +%s.%N)"; pids; echo "loadtest $(cat /proc/$L/stat | awk '{print $14+$15}')"
  sleep 1; while kill -0 $L 2>/dev/null; do LT=$(cat /proc/$L/stat 2>/dev/null | awk '{print $14+$15}'); sleep 0.5; done
  echo "== $mode end $(date +%s.%N)"; pids; echo "loadtest-last $LT"
  grep -E "Output token throughput|output_throughput|tok/s" $OUT/lt-$mode.log | head -3
done
kill $UP; wait $UP
