"""Starting the ranks: the parent's self-launch and each worker's entry point.

Parent (`spawn_workers`): writes the resolved recipe to ``output_dir/.launch/recipe.yaml`` and
runs

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m lctrain.train.launch --config output_dir/.launch/recipe.yaml --error-dir ... [--resume]

Rank 0's progress goes straight to this terminal (stdout is inherited); the workers' stderr
(library warnings, torchrun's own reports) goes to ``output_dir/.launch/workers.log``. When a
rank fails it records its exception in the error folder; the parent then reports the FIRST
failure in time — the real cause, not the "connection reset" that other ranks see next — as a
`UserError` (one sentence) or, for a bug, as that rank's traceback.

Worker (`main`): loads the recipe and calls `lctrain.train.runner.run_worker`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

from lctrain.config import RecipeConfig, load_recipe, save_resolved
from lctrain.errors import UserError

USER_ERROR_EXIT = 2


def spawn_workers(cfg: RecipeConfig, *, nproc: int, resume: bool) -> int:
    """Run ``nproc`` local ranks through torch.distributed.run; returns 0 on success.

    Raises:
        UserError: the first failing rank failed with a UserError (its message).
    """
    launch_dir = Path(cfg.train.output_dir) / ".launch"
    errors = launch_dir / "errors"
    shutil.rmtree(errors, ignore_errors=True)
    errors.mkdir(parents=True)
    recipe = save_resolved(cfg, launch_dir / "recipe.yaml")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "lctrain.train.launch",
           "--config", str(recipe), "--error-dir", str(errors)]
    if resume:
        cmd.append("--resume")
    log = launch_dir / "workers.log"
    with log.open("w") as stderr:
        code = subprocess.run(cmd, env=_worker_env(nproc), stderr=stderr, check=False).returncode
    if code == 0:
        return 0
    first = first_error(errors)
    if first is None:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        print("\n".join(tail), file=sys.stderr)
        print(f"training failed (exit code {code}); the workers' log is {log}", file=sys.stderr)
        return code or 1
    if first["user"]:
        raise UserError(first["message"])
    print(f"rank {first['rank']} failed:\n{first['traceback']}", file=sys.stderr)
    print(f"(the workers' log is {log})", file=sys.stderr)
    return code or 1


def _worker_env(nproc: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def first_error(error_dir: str | os.PathLike) -> dict | None:
    """The earliest recorded rank failure in ``error_dir``, or None if no rank recorded one."""
    records = []
    for path in Path(error_dir).glob("rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return min(records, key=lambda r: r["time"]) if records else None


def record_error(error_dir: str | os.PathLike | None, exc: BaseException) -> None:
    """Write this rank's failure as ``rank{R}.json`` (atomically) for the parent to report."""
    if error_dir is None:
        return
    rank = int(os.environ.get("RANK", "0"))
    record = {"rank": rank, "time": time.time(), "user": isinstance(exc, UserError),
              "message": str(exc) or type(exc).__name__,
              "traceback": "".join(traceback.format_exception(exc))}
    path = Path(error_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Worker entry point (one per rank, started by torch.distributed.run)."""
    parser = argparse.ArgumentParser(prog="python -m lctrain.train.launch")
    parser.add_argument("--config", required=True, help="resolved recipe YAML")
    parser.add_argument("--error-dir", default=None, help="where a failing rank records why")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    from lctrain.train.runner import run_worker

    try:
        return run_worker(load_recipe(args.config), resume=args.resume)
    except UserError as exc:
        record_error(args.error_dir, exc)
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT
    except BaseException as exc:
        record_error(args.error_dir, exc)
        raise


if __name__ == "__main__":
    sys.exit(main())
