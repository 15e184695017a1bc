"""The memory model against every GPU peak measured by ``lctrain bench step`` and published in
docs/performance/: the model's ``peak_allocated`` for the recipe as run is within 10 % of
``torch.cuda.max_memory_allocated`` (the rows' ``peak_gib``), and its ``host_offload`` within
10 % of the pinned host memory the run held (``host_gib``: the offloaders' pinned pools and
host-resident state, counted by `lctrain.parallel.offload.host_memory_bytes`). An ``auto`` row
is estimated with the layer policies it ran (``layer_policies``), placed for its GPU.

With the document mask on, the model budgets the attention of a row that is one document (the
rows of a run differ, and a later row must fit too); rows of shorter documents leave blocks
empty, which the distributed attention skips with their buffers, so there the model is a
bound: the peak is at most 10 % above it and not below half of it."""
import json
import shlex
from pathlib import Path

import pytest

from lctrain.config import load_recipe
from lctrain.memory import estimate_recipe

GIB = 1 << 30
RESULTS = sorted(Path(__file__).resolve().parent.parent.glob("docs/performance/*-step*.json"))


def _rows():
    for path in RESULTS:
        result = json.loads(path.read_text())
        command = shlex.split(result["meta"]["command"])
        recipe = command[3]
        base = [command[i + 1] for i, word in enumerate(command)  # the data file was the
                if word == "--set" and not command[i + 1].startswith("data.source=")]  # run's
        for row in result["rows"]:
            if row.get("status") == "ok":
                # rows that do not say ran before norms, MLPs or the loss were fused, the
                # projections grouped with the heads or the norms deferred: without them
                eager = [f"model.{key}=false" for key in ("fused_norms", "fused_mlp", "fused_loss",
                                                          "grouped_attention", "deferred_norms")
                         if key not in row]
                yield pytest.param(recipe, eager + base, row,
                                   id=f"{path.stem}-{row['seq_len']}-{row['variant'] or 'recipe'}")


@pytest.mark.parametrize("recipe, base, row", list(_rows()))
def test_model_within_ten_percent_of_measured_peaks(recipe, base, row):
    placed = [f"train.layer_policies={row['layer_policies']}"] if row.get("layer_policies") else []
    cfg = load_recipe(recipe, [*base, *shlex.split(row["variant"] or ""), *placed],
                      seq_len=row["seq_len"])
    assert cfg.train.checkpointing == row["policy"] and cfg.parallel.schedule == row["schedule"]
    assert cfg.model.fused_norms == row.get("fused_norms", cfg.model.fused_norms)
    assert cfg.model.fused_mlp == row.get("fused_mlp", cfg.model.fused_mlp)
    assert cfg.model.fused_loss == row.get("fused_loss", cfg.model.fused_loss)
    assert cfg.model.grouped_attention == row.get("grouped_attention",
                                                  cfg.model.grouped_attention)
    assert cfg.model.deferred_norms == row.get("deferred_norms", cfg.model.deferred_norms)
    est = estimate_recipe(cfg, seq_len=row["seq_len"], gpus=row["gpus"], gpu_memory=139 * GIB)
    model = est.details["peak_allocated"] / GIB
    if cfg.data.document_mask and row["peak_gib"] < model:
        assert row["peak_gib"] >= 0.5 * model, (row["peak_gib"], model)
    else:
        assert abs(row["peak_gib"] / model - 1) <= 0.10, (row["peak_gib"], model)
    if row.get("host_gib"):
        host = est.details["host_offload"] / GIB
        assert abs(row["host_gib"] / host - 1) <= 0.10, (row["host_gib"], host)
