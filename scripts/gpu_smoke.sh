#!/usr/bin/env bash
# One GPU session's correctness pass: GPU-marked tests, then the tiny recipe on every GPU over
# NCCL (cp = number of GPUs) in fp32 with FSDP2 on and off (same losses), and in bf16.
set -u
. scripts/gpu_setup.sh
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider "$@" 2>&1 | tee $OUT/pytest_gpu.log | tail -25
for v in "fsdp=off:--set parallel.fsdp=off" "fsdp=on:--set parallel.fsdp=on" "bf16:--set parallel.fsdp=on --set train.mixed_precision=bf16"; do
  name=${v%%:*}; args=${v#*:}
  echo "== tiny recipe, $n GPUs, cp=$n, $name"
  timeout 150 lctrain finetune --set parallel.cp=$n --max-steps 10 --output-dir /tmp/run-$name $args 2>&1 | tail -4
  cp /tmp/run-$name/metrics.jsonl $OUT/metrics-$name.jsonl 2>/dev/null
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
runs = {n: [json.loads(l)["loss"] for l in open(f"{out}/metrics-{n}.jsonl")] for n in ("fsdp=off", "fsdp=on", "bf16") if os.path.exists(f"{out}/metrics-{n}.jsonl")}
for n, l in runs.items(): print(f"{n:9s}", " ".join(f"{x:.4f}" for x in l))
if "fsdp=off" in runs and "fsdp=on" in runs:
    print("max rel diff fsdp on/off:", max(abs(a-b)/abs(a) for a, b in zip(runs["fsdp=off"], runs["fsdp=on"])))
PY
