"""A mistake in the command line itself — an unknown command or option, a missing argument or
value, a value of the wrong kind — is one line on stderr naming the command's --help, with exit
code 2, for every command; no arguments at all still show the help."""
from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from lctrain.cli import app

COMMANDS = [["finetune"], ["estimate-memory"], ["export"], ["eval"], ["report"],
            ["bench", "kernel"], ["bench", "attention"], ["bench", "step"],
            ["bench", "report"]]


def _usage_error(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_an_unknown_option_of_any_command_is_one_line(command):
    path = " ".join(["lctrain", *command])
    line = _usage_error([*command, "--no-such-option"])
    assert line.startswith("error: no such option: --no-such-option"), line
    assert line.endswith(f"; see {path} --help"), line
    assert CliRunner().invoke(app, [*command, "--help"]).exit_code == 0  # the hint works


@pytest.mark.parametrize("args, line", [
    (["no-such-command"], "error: no such command 'no-such-command'; see lctrain --help"),
    (["bench", "nope"], "error: no such command 'nope'; see lctrain bench --help"),
    (["--no-such-option"], "error: no such option: --no-such-option; see lctrain --help"),
    (["export"], "error: missing argument 'RUN_DIR'; see lctrain export --help"),
    (["finetune", "--max-steps", "0"], "error: invalid value for '--max-steps': Input should be "
                                       "greater than or equal to 1; see lctrain finetune --help"),
    (["finetune", "--set"], "error: option '--set' requires an argument; see lctrain finetune "
                            "--help"),
])
def test_usage_errors_say_what_and_where_help_is(args, line):
    assert _usage_error(args) == line


def test_no_arguments_still_show_the_help():
    for args in ([], ["bench"]):
        result = CliRunner().invoke(app, args)
        assert "Usage: " in result.output and "Commands:" in result.output
        assert "error:" not in result.output


def test_the_installed_program_prints_one_line():
    done = subprocess.run([sys.executable, "-m", "lctrain", "report", "--bogus"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "error: no such option: --bogus; see lctrain report --help\n"
