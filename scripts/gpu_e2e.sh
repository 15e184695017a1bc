#!/usr/bin/env bash
# Llama-7B architecture (random init), full fine-tune, FSDP2 over all GPUs, cp = GPUs, through
# `lctrain bench step`: checkpointing policies and attention schedules side by side.
# Usage: bash scripts/gpu_e2e.sh "LEN:POLICY:STEPS[:SCHEDULE[:WARMUP]] ..." [deadline_s]
#   e.g. "64k:remat:2 64k:remat:2:context_parallel 512k:remat-offload:1:distflash:0" (SCHEDULE
#   default distflash; context_parallel = torch's own ring, the peer; WARMUP untimed steps first,
#   default 1). Overrides for every run go in E2E_SET
#   (default: one causal sequence per row, --set data.document_mask=false).
set -u
. scripts/gpu_setup.sh
runs=${1:-"64k:remat:2 64k:full:2 256k:remat-offload:1"}
deadline=$(( $(date +%s) + ${2:-540} ))
for r in $runs; do
  IFS=: read -r len policy steps schedule warmup <<<"$r"
  schedule=${schedule:-distflash}; warmup=${warmup:-1}
  left=$(( deadline - $(date +%s) ))
  [ "$left" -gt 60 ] || { echo "== $r skipped: time"; continue; }
  echo "== llama-7b $len $policy $schedule ($steps timed steps, ${left}s left)"
  timeout "$left" lctrain bench step recipes/llama-7b-256k.yaml --seq-len "$len" --steps "$steps" \
    --warmup "$warmup" \
    --set train.checkpointing="$policy" --set parallel.schedule="$schedule" \
    ${E2E_SET:---set data.document_mask=false} \
    --json "$OUT/step-$len-$policy-$schedule.json" 2>&1 | grep -E "^step|^error|Error|out of memory" | tail -4
done
python3 scripts/e2e_table.py "$OUT"/step-*.json
