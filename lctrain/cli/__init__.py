"""The ``lctrain`` command line (Typer): each command parses, makes one library call, renders."""
from __future__ import annotations

import typer

from lctrain.cli import bench
from lctrain.cli.usage import OneLineUsage
from lctrain.cli.memory import estimate_memory
from lctrain.cli.eval import eval_command
from lctrain.cli.export import export
from lctrain.cli.finetune import finetune
from lctrain.cli.report import report

app = typer.Typer(
    name="lctrain", cls=OneLineUsage, no_args_is_help=True, add_completion=False,
    pretty_exceptions_enable=False, rich_markup_mode=None,
    help="Fine-tune language models on very long contexts with DistFlashAttn (balanced, "
         "overlapped sequence-parallel attention).")


def _version(value: bool) -> None:
    if value:
        from lctrain.report.versions import describe, environment

        typer.echo(describe(environment()))
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True,
        help="Print the versions of lctrain, torch, triton, transformers and CUDA, and exit.")
          ) -> None:
    pass


app.command("finetune")(finetune)
app.command("estimate-memory")(estimate_memory)
app.add_typer(bench.app, name="bench")
app.command("export")(export)
app.command("eval")(eval_command)
app.command("report")(report)


def main() -> None:
    """Entry point of the ``lctrain`` script and of ``python -m lctrain``."""
    app(prog_name="lctrain")


__all__ = ["app", "main"]
