"""One rank of a self-launched evaluation: ``python -m lctrain.eval --config C --request R ...``."""
import sys

from lctrain.launch.lifetime import die_with_launcher

if __name__ == "__main__":
    die_with_launcher(levels=2)  # as a training rank: it must not outlive the launcher
    from lctrain.eval.evaluate import worker_entry

    sys.exit(worker_entry())
