"""``lctrain data preview``: the training data as training will see it, before a GPU hour is
spent."""
from __future__ import annotations

import contextlib
import sys
from typing import Annotated

import typer

from lctrain.cli.options import RecipeArg, SeqLenOpt, SetOpt, user_errors
from lctrain.config import load_recipe
from lctrain.report.table import Column, Table, emit, say, show

app = typer.Typer(help="Look at the training data as training will see it.",
                  no_args_is_help=True, add_completion=False, rich_markup_mode=None)

RowsOpt = Annotated[int, typer.Option("--rows", min=1, metavar="N",
                                      help="Packed rows to show, from the first.")]


@app.command("preview")
def preview(recipe: RecipeArg = None, seq_len: SeqLenOpt = None, overrides: SetOpt = None,
            rows: RowsOpt = 2) -> None:
    """Print the first packed rows of a recipe's data: each document's text with its trained
    tokens marked (in colour on a terminal, in [[...]] otherwise), then per row its tokens,
    trained tokens (labels), documents and padding.

    The data is read, tokenized and packed as lctrain finetune does it (into the same cache,
    which the run then reuses), in this process; only the tokenizer is loaded, no model.

    \b
    Examples:
      lctrain data preview --set data.source=pairs.jsonl --rows 1
      lctrain data preview llama-7b-64k --seq-len 16k --set data.source='chats/*.jsonl'
    """
    with user_errors():
        cfg = load_recipe(recipe, overrides or [], seq_len=seq_len)
        from lctrain.data import prepare_data, rows_summary
        from lctrain.data.preview import heading, here, preview_rows
        from lctrain.model import load_tokenizer

        tokenizer = load_tokenizer(cfg)
        with contextlib.redirect_stdout(sys.stderr):  # progress; stdout is the preview
            packed = prepare_data(cfg.data, tokenizer, show_progress=True, seed=cfg.train.seed)
        shown = preview_rows(packed, tokenizer, rows)
    for line in rows_summary(packed):  # the cache line (a time) on stderr, with the progress
        (say if line.startswith("cache: ") else emit)(here(line))
    console = None
    if sys.stdout.isatty():
        from rich.console import Console

        console = Console(highlight=False, soft_wrap=True, emoji=False, markup=False)
    for row in shown:
        _print(console, f"\nrow {row.index + 1} of {len(packed):,}", "bold")
        for piece in row.pieces:
            _print(console, f"-- {heading(piece)}", "cyan")
            _print(console, piece.runs)
    keys = ("tokens", "trained", "documents", "padding")
    emit("")
    show(Table("", [Column(key, key, "figure") for key in ("row", *keys)],
               [{"row": f"{r.index + 1:,}", **{k: f"{getattr(r, k):,}" for k in keys}}
                for r in shown], keys=1), "table", False)


def _print(console, what, style: str = "") -> None:
    """A heading (``style``) or a piece's (text, trained) runs, in colour on a terminal."""
    from lctrain.data.preview import bracketed

    if console is None:
        emit(what if isinstance(what, str) else bracketed(what))
        return
    from rich.text import Text

    console.print(Text(what, style=style) if isinstance(what, str) else Text.assemble(
        *((text, "bold green" if trained else "dim") for text, trained in what)))
