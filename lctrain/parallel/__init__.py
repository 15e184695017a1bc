"""Parallelism applied from outside the model: the dp × cp mesh, context parallelism (how each
sequence is cut over the cp ranks and which attention spans the cut: `lctrain.parallel.context`),
FSDP2 / replication, and activation-checkpointing policies (`lctrain.parallel.activation_checkpoint`).

    pmesh = build_mesh(cp=2, device_type="cuda")          # dp = world size // cp
    cp = ContextParallel(pmesh, "distflash", "auto", device=device)
    dist = distribute(module, decoder_layers(model), world_mesh=pmesh.world_mesh, strategy="fsdp")
"""
from lctrain.parallel.fsdp import Distributed, allreduce_gradients, distribute
from lctrain.parallel.mesh import ParallelMesh, build_mesh, check_parallel_sizes
