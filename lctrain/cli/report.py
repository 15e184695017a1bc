"""``lctrain report RUN_DIR...``: a summary of training runs, and their loss curves."""
from __future__ import annotations

import json

import typer

from lctrain.cli.usage import user_errors
from lctrain.cli.options import Format, FormatOpt, PlotOpt, WideOpt


def report(runs: list[str] = typer.Argument(
               ..., metavar="RUN_DIR", help="Run folders (train.output_dir of lctrain finetune)."),
           plot: PlotOpt = None, fmt: FormatOpt = Format.table, wide: WideOpt = False) -> None:
    """Summarise training runs: the settings that differ, steps, final and best loss, eval loss,
    tokens/s, MFU, peak memory and time; --plot draws their loss curves.

    \b
    Example:
      lctrain report runs/full runs/remat --plot losses.png
    """
    with user_errors():
        from lctrain.report.output import say, show
        from lctrain.report.plotting import check_target
        from lctrain.report.runs import load_runs, plot_losses, row, summary

        if plot is not None:
            check_target(plot)
        loaded = load_runs(runs)
        table = summary(loaded)
        if fmt == Format.json:
            keys = [c.key for c in table.columns if "." in c.key]
            typer.echo(json.dumps([row(run, keys) for run in loaded], indent=2, default=str))
        else:
            show(table, fmt.value, wide)
        if plot is not None:
            say(f"wrote the plot to {plot_losses(loaded, plot)}")
