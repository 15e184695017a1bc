#!/usr/bin/env python3
"""Print the rows of several `lctrain bench step --json` files as one table (gpu_e2e.sh's end).

    python scripts/e2e_table.py OUT/step-*.json
"""
import json
import pathlib
import sys

KEYS = ["seq_len", "policy", "schedule", "gpus", "step_time_s", "tokens_per_s", "mfu", "peak_gib",
        "model_peak_gib", "peak_vs_model", "attn_fwd_per_step", "attn_fwd_expected",
        "loss_first", "loss_last"]


def cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main(paths: list[str]) -> None:
    print(" | ".join(KEYS))
    for path in sorted(p for p in paths if pathlib.Path(p).is_file()):  # a failed run wrote none
        data = json.load(open(path))
        for row in data["rows"]:
            row = {**row, "schedule": data["meta"].get("schedule")}
            print(" | ".join(cell(row.get(k)) for k in KEYS))


if __name__ == "__main__":
    main(sys.argv[1:])
