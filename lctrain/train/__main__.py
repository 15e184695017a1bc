"""One rank of a self-launched run (`lctrain.train.launch.spawn_workers` starts N of them
through torch.distributed.run):

    python -m lctrain.train --config RECIPE.yaml [--config-sha256 HEX] [--error-dir DIR]
        [--store FILE] [--resume]
"""
import sys

from lctrain.train.launch import worker_main
from lctrain.train.runner import run_worker

if __name__ == "__main__":
    sys.exit(worker_main(run_worker))
