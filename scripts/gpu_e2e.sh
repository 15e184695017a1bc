#!/usr/bin/env bash
# Llama-7B architecture (random init), bf16, full fine-tune, FSDP2 over all GPUs, cp = GPUs,
# through `lctrain bench step`: checkpointing policies side by side, then the longest lengths.
# Usage: bash scripts/gpu_e2e.sh "64k:remat:2 64k:full:2 256k:remat-offload:1" [deadline_s]
# Extra recipe overrides for every run go in E2E_SET, e.g. E2E_SET="--set model.dtype=bfloat16".
set -u
. scripts/gpu_setup.sh
runs=${1:-"64k:remat:2 64k:full:2 256k:remat-offload:1"}
deadline=$(( $(date +%s) + ${2:-540} ))
for r in $runs; do
  IFS=: read -r len policy steps <<<"$r"
  left=$(( deadline - $(date +%s) ))
  [ "$left" -gt 60 ] || { echo "== $r skipped: time"; continue; }
  echo "== llama-7b $len $policy ($steps timed steps, ${left}s left)"
  timeout "$left" lctrain bench step recipes/llama-7b-256k.yaml --seq-len "$len" --steps "$steps" \
    --set train.checkpointing="$policy" --set data.document_mask=false ${E2E_SET:-} \
    --json "$OUT/step-$len-$policy.json" 2>&1 | grep -E "^step|^error|Error|out of memory" | tail -4
done
python3 - <<'PY'
import glob, json, os
keys = ["seq_len", "policy", "gpus", "step_time_s", "tokens_per_s", "mfu", "peak_gib", "model_peak_gib",
        "peak_vs_model", "attn_fwd_per_step", "attn_fwd_expected", "loss_first", "loss_last"]
print(" | ".join(keys))
for f in sorted(glob.glob(os.environ["OUT"] + "/step-*.json")):
    row = json.load(open(f))["rows"][0]
    print(" | ".join(f"{row[k]:.4g}" if isinstance(row.get(k), float) else str(row.get(k)) for k in keys))
PY
