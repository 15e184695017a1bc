"""Parallelism applied from outside the model: the dp × cp mesh (`lctrain.parallel.mesh`), context
parallelism (`lctrain.parallel.context`), FSDP2 / replication, and activation-checkpointing
policies (`lctrain.parallel.activation_checkpoint`)."""
from lctrain.parallel.fsdp import Distributed, distribute
from lctrain.parallel.mesh import ParallelMesh, build_mesh, check_parallel_sizes
