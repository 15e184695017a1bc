"""What a user reads in a narrow terminal: the memory estimate and plan tables, narrow and
--wide, fit 60 columns when rendered for a terminal of that width."""
from __future__ import annotations

import pytest

from lctrain.config import load_recipe
from lctrain.memory import estimate_recipe, plan_recipe
from lctrain.memory.tables import estimate_table, plan_table
from lctrain.report.table import render

GIB = 1 << 30


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("recipe, gpus, host", [("llama-7b-256k", 2, 251 * GIB),
                                                ("llama3.1-8b-random-128k", 2, 128 * GIB)])
def test_estimate_and_plan_tables_fit_sixty_columns(recipe, gpus, host, wide):
    cfg = load_recipe(recipe)
    est = estimate_recipe(cfg, seq_len=512 * 1024, gpus=gpus, gpu_memory=139 * GIB)
    plan = plan_recipe(cfg, model=None, gpus=gpus, gpu_memory=139 * GIB, host_memory=host,
                       gpus_per_node=None, seq_len=512 * 1024)
    for table in (estimate_table(est.to_json(), 139 * GIB), plan_table(plan)):
        text = render(table, "table", wide=wide, terminal=True, width=60)
        assert max(len(line) for line in text.splitlines()) <= 60, text
        for row in table.rows:  # nothing is cut: every row's first cell is still there
            first = str(row[table.columns[0].key])
            assert first in text, (first, text)
        markdown = render(table, "markdown", wide=wide).splitlines()
        headers = next(ln for ln in markdown if ln.startswith("|")).strip("| ").split(" | ")
        assert all(label.split(" (")[0] in text for label in headers), (headers, text)
