"""The launcher's child: torch.distributed.run, tied to the launcher, telling how each rank ended.

    python -m lctrain.launch.agent FAILURES.json [torch.distributed.run arguments ...]

It runs torch.distributed.run in this process (`torch.distributed.run.parse_args` / `run`: the
same arguments, the same rendezvous and worker environment as ``torchrun``) with three
additions: it dies with the launcher (`lctrain.launch.lifetime.die_with_launcher`); it ignores
stop signals, which are the launcher's to handle (torchrun's own handling would pass them to the
ranks a second time, and then kill them 30 s later); and when ranks fail it writes their pids
and exit codes to FAILURES.json — a negative code is the signal that killed a rank, which the
rank itself can no longer record — for `lctrain.launch.failures.explain`.
"""
from __future__ import annotations

import json
import os
import signal
import sys

from lctrain.launch.lifetime import die_with_launcher
from lctrain.launch.stopping import STOP_SIGNALS


def main(argv: list[str]) -> int:
    """Run torch.distributed.run with ``argv[1:]``; returns 0, or 1 when a rank failed."""
    die_with_launcher(levels=1)
    for sig in STOP_SIGNALS:  # a handler, not SIG_IGN: the ranks must not inherit "ignore"
        signal.signal(sig, _ignore)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    failures_path, args = argv[0], parse_args(argv[1:])
    if hasattr(args, "signals_to_handle"):  # torch >= 2.8 would install handlers for them
        args.signals_to_handle = "SIGQUIT"
    try:
        run(args)
    except ChildFailedError as error:
        failures = {str(rank): {"pid": f.pid, "exitcode": f.exitcode, "local_rank": f.local_rank}
                    for rank, f in error.failures.items()}
        tmp = f"{failures_path}.tmp"
        with open(tmp, "w") as handle:
            json.dump(failures, handle)
        os.replace(tmp, failures_path)
        return 1
    return 0


def _ignore(signum: int, frame) -> None:
    """Stop signals are the launcher's to handle."""


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the ranks have ended; torch's teardown would only cost time
