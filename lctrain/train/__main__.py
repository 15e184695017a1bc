"""One rank of a self-launched run: ``python -m lctrain.train --config RECIPE.yaml ...``.

It ties its life to the launcher and installs its stop-signal handlers before the heavy
imports, and ends with ``os._exit`` once its streams are flushed (everything it wrote is
closed by then; the interpreter's teardown would only cost time).
"""
import functools
import os
import sys

from lctrain.launch.lifetime import die_with_launcher
from lctrain.launch.stopping import StopRequest

if __name__ == "__main__":
    die_with_launcher(levels=2)
    stop = StopRequest().__enter__()  # for the life of the process
    from lctrain.launch.rank import worker_main
    from lctrain.train.runner import run_worker

    code = worker_main(functools.partial(run_worker, stop=stop))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
