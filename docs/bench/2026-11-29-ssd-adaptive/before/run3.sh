#!/bin/bash
# Before (3a83c23), against the stack of run.sh: fixed SSD and adaptive with SSD at 1 session.
set -u
cd /work/main
OUT=/work/ssd1/out
D=sdk/specdec/sdk/loadtest/prompts.jsonl
.venv/bin/specdec loadtest --gateway 127.0.0.1:50561 --concurrency 1 --modes k3,ssd3,ssd2,adaptive \
    --prompts $D --num-requests 16 --max-new-tokens 32 --output-len-range 0.5 --no-progress \
    --out $OUT/torch-1-ssd > $OUT/torch-1-ssd.log 2>&1
echo "$(date +%T) done"
