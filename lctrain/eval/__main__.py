"""One rank of a self-launched evaluation (`lctrain.eval.run.evaluate` starts N of them through
torch.distributed.run):

    python -m lctrain.eval --config RECIPE.yaml [--error-dir DIR] --request REQUEST.json
"""
import sys

from lctrain.eval.run import worker_entry

if __name__ == "__main__":
    sys.exit(worker_entry())
