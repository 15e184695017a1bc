"""One rank of a self-launched evaluation (`lctrain.eval.run.evaluate` starts N of them through
torch.distributed.run):

    python -m lctrain.eval --config RECIPE.yaml [--config-sha256 HEX] [--error-dir DIR]
        [--store FILE] --request REQUEST.json
"""
import sys

from lctrain.launch.lifetime import die_with_launcher

if __name__ == "__main__":
    die_with_launcher(levels=2)  # as a training rank: it must not outlive the launcher
    from lctrain.eval.run import worker_entry

    sys.exit(worker_entry())
