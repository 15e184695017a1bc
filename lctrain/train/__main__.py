"""One rank of a self-launched run (`lctrain.launch.launcher.spawn_workers` starts N of them
through torch.distributed.run):

    python -m lctrain.train --config RECIPE.yaml [--config-sha256 HEX] [--error-dir DIR]
        [--store FILE] [--resume]

The rank ties its life to the launcher's and installs its stop-signal handlers first, before
the heavy imports (`lctrain.launch.lifetime`, `lctrain.launch.stopping`). It ends with
``os._exit`` once its streams are flushed: everything it writes (checkpoints, metrics, error
records) is closed by then, and the interpreter's teardown of torch, transformers and the rest
costs seconds of CPU for nothing.
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
