"""What one rank's run is built from (`RunSetup`) and the model as the loop trains it
(`ModelParts`): the records that `lctrain.train.runner` passes between its steps."""
from __future__ import annotations

import dataclasses

from accelerate import Accelerator
from torch import nn

from lctrain.config import RecipeConfig
from lctrain.parallel.context import ContextParallel
from lctrain.parallel.fsdp import Distributed
from lctrain.parallel.mesh import ParallelMesh
from lctrain.train.metrics import FlopModel
from lctrain.train.stopping import StopRequest


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What every part of one rank's run is built from.

    Attributes:
        cfg: the recipe, with ``parallel.dp`` resolved.
        pmesh: the dp × cp mesh and this rank's place in it.
        cp: how this rank holds and attends over its part of every sequence.
        accelerator: device, mixed precision, autocast and backward.
        stop: the stop-signal flag of this process.
        control: the gloo group the ranks agree on it over (None: one rank).
    """

    cfg: RecipeConfig
    pmesh: ParallelMesh
    cp: ContextParallel
    accelerator: Accelerator
    stop: StopRequest = dataclasses.field(default_factory=StopRequest)
    control: object = None

    @property
    def main(self) -> bool:
        """Whether this is rank 0 (the one that prints and writes shared files)."""
        return self.pmesh.rank == 0


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """The model as the loop trains it.

    Attributes:
        model: the causal LM (inside ``distributed.module``).
        distributed: the `CausalLMLoss` around it, spread over the ranks.
        flops: its FLOP model (for MFU).
        n_params: its parameter count.
        layer_policies: the layers' checkpointing policies of an ``auto`` run (runs text).
    """

    model: nn.Module
    distributed: Distributed
    flops: FlopModel
    n_params: int
    layer_policies: str | None = None


def rows_per_step(setup: RunSetup) -> int:
    """Packed rows one optimizer step takes over all ranks (the global batch)."""
    return setup.pmesh.dp * setup.cfg.train.batch_size * setup.cfg.train.grad_accum
