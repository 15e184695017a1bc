"""The step-time model: the FLOPs of one optimizer step (matmuls, causal attention over the whole
sequence, recomputation, tiles), the matmuls at one rate per GPU and the attention at another,
beside the host copies they overlap with and the host-resident training state they do not. The
two rates are fit to the dense steps published in benchmarks/results (every GPU and length
there, 64K to 1376K: attention from half to nearly all of a step's FLOPs). Packed documents
attend the share ``Setup.attended`` of a one-document row's pairs."""
from __future__ import annotations

import math

from lctrain.memory.activations import grouped

MATMUL_FLOPS = 0.56 * 989e12
"""FLOP/s of a step's matmuls on one H100/H200, with the step's other work folded in (fit)."""
ATTENTION_FLOPS = 0.665 * 989e12
"""FLOP/s of its attention, forward, backward and recomputed (fit)."""
PCIE_BYTES = 50e9
"""Host <-> GPU copy rate per GPU and direction: pinned memory over PCIe 5 x16 (64 GB/s)."""
HOST_UPDATE_BYTES = 4e9
"""Assumed rate of a CPU AdamW update, in bytes of state per second per process."""
CP_OVERHEAD = 0.02
"""Step time added per doubling of cp (communication that overlap does not hide)."""
GROUP_OVERHEAD = 0.005
"""Step time added by running the attention in head groups."""


def step_seconds(setup, seq_len: int, details: dict) -> float:
    """Estimated seconds of one optimizer step of ``setup`` (an `lctrain.memory.estimate.Setup`,
    its layers placed) at ``seq_len``, from its memory ``details`` (module docstring)."""
    arch = setup.arch
    tokens = details["tokens_per_gpu"] * setup.grad_accum
    layers, h = arch.num_layers, arch.hidden_size
    mlp = 3 * h * arch.intermediate_size
    linear = 6 * (layers * arch.layer_parameters() + arch.vocab_size * h) * tokens
    attention_fwd = (2 * seq_len ** 2 * setup.attended * arch.q_width / setup.cp
                     * setup.batch_size * setup.grad_accum)
    plan = setup.layers
    checkpointed = layers - plan.count("none", layers)
    recompute = 2 * checkpointed * arch.layer_parameters() * tokens
    tiles = 2 * layers * mlp * tokens if 0 < setup.tile_tokens < details["tokens_per_gpu"] else 0
    if grouped(arch, setup.lora, setup.head_groups):
        qkv = 2 * h * (arch.q_width + 2 * arch.kv_width) * tokens
        recompute += qkv * (layers - plan.count("remat", layers))
    attention = (layers * 3.5 + plan.count("full", layers)) * attention_fwd
    compute = (linear + recompute + tiles) / MATMUL_FLOPS + attention / ATTENTION_FLOPS
    copies = 2 * details["host_activations"] * setup.grad_accum / PCIE_BYTES
    seconds = max(compute, copies) + _state_seconds(setup, details)
    overhead = CP_OVERHEAD * math.log2(setup.cp) + GROUP_OVERHEAD * (setup.head_groups > 1)
    return seconds * (1 + overhead)


def _state_seconds(setup, details: dict) -> float:
    """Per-step time of training state in host memory (not overlapped with compute)."""
    state = details["host_state"]
    if setup.layers.state == "optimizer":
        return 2 * state / PCIE_BYTES
    if setup.layers.state == "state":
        params = state / 4  # master weights: a quarter of (weights, gradients, two moments)
        return (3 * params) / PCIE_BYTES + state / HOST_UPDATE_BYTES
    return 0.0
