#!/usr/bin/env bash
# torch's context_parallel as a training schedule against distflash: the tiny recipe on every GPU
# (cp = number of GPUs), one causal sequence per row, bf16; the two loss curves must agree.
set -u
. scripts/gpu_setup.sh
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
for s in distflash context_parallel; do
  echo "== tiny recipe, $n GPUs, cp=$n, schedule $s"
  timeout 150 lctrain finetune --set parallel.cp=$n --set parallel.schedule=$s --max-steps 6 \
    --set data.document_mask=false --set train.mixed_precision=bf16 --output-dir /tmp/peer-$s 2>&1 | tail -2
  cp /tmp/peer-$s/metrics.jsonl $OUT/peer-$s.jsonl 2>/dev/null
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
runs = {n: [json.loads(l)["loss"] for l in open(f"{out}/peer-{n}.jsonl")]
        for n in ("distflash", "context_parallel") if os.path.exists(f"{out}/peer-{n}.jsonl")}
for n, losses in runs.items():
    print(f"{n:17s}", " ".join(f"{x:.4f}" for x in losses))
if len(runs) == 2:
    diff = max(abs(a - b) / abs(a) for a, b in zip(*runs.values()))
    print(f"max rel loss diff distflash vs context_parallel: {diff:.2e} ->", "PASS" if diff < 2e-2 else "FAIL")
PY
