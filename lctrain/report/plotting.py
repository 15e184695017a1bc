"""Plots: matplotlib made ready (or one sentence why not) and one house style. Call
:func:`check_target` before the work that produces the data."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from lctrain.errors import UserError, unwritable
from lctrain.report.human import tokens
from lctrain.report.table import writable

FILE_TYPES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def check_target(path: str | Path) -> Path:
    """The plot file to write, checked before any work (UserError: matplotlib is missing, the
    file type is not one it writes, or the file cannot be written)."""
    target = Path(path).expanduser()
    if target.suffix.lower() not in FILE_TYPES:
        raise UserError(f"--plot {path}: the file name must end in one of "
                        f"{', '.join(FILE_TYPES)}, e.g. attention.png")
    if importlib.util.find_spec("matplotlib") is None:
        raise UserError("--plot needs matplotlib, which is not installed here; pip install "
                        "matplotlib, or drop --plot")
    return writable(target, "--plot")


def figure(title: str, xlabel: str, ylabel: str):
    """A new (figure, axes) with the house style; a UserError without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plotting needs matplotlib, which is not installed here; pip install "
                        "matplotlib") from None
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.set_title(title, fontsize=11, loc="left")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def length_axis(ax, lengths: list[int]) -> None:
    """A log-2 x axis ticked at the given sequence lengths, labelled 64K, 128K, ..."""
    ticks = sorted({int(n) for n in lengths})
    if ticks and ticks[0] > 0:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [tokens(n) for n in ticks])
        ax.minorticks_off()
        pad = 2 ** 0.25
        ax.set_xlim(ticks[0] / pad, ticks[-1] * pad)


def finish(fig, ax, path: str | Path, legend: bool = True) -> Path:
    """Put the legend outside the data on the right, write the file, close the figure."""
    import matplotlib.pyplot as plt

    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    target = writable(path, "--plot")
    try:
        fig.savefig(target, dpi=130, bbox_inches="tight")
    except OSError as error:
        raise unwritable(f"--plot {path}", error) from None
    finally:
        plt.close(fig)
    return target
