"""Bytes of activations and transient buffers of one GPU, per checkpointing policy.

Notation: T tokens on this GPU (batch × seq_len / cp), h hidden, I intermediate, Hq / Hkv heads,
d head dim, c bytes of the compute dtype (2 for bf16), L layers, V vocabulary.

What one transformers Llama-style decoder layer saves for its backward (no checkpointing):

    each RMSNorm (two)   fp32 upcast of its input 4·T·h (pow / mul save it), the normalised
                         value before the weight c·T·h, its output c·T·h (saved by the next
                         linears), rsqrt 4·T                                   -> (4 + 2c)·T·h
    q, k, v after RoPE   c·T·(Hq + 2·Hkv)·d (RoPE's muls save only cos / sin, shared)
    attention out, lse   c·T·Hq·d (also o_proj's input) + 4·T·Hq
    gated MLP            gate, SiLU(gate), up, SiLU(gate)·up: 4·c·T·I

Policies (see lctrain.parallel.checkpointing):

- none: all of the above for every layer;
- full: each layer's input c·T·h; in the backward one layer is recomputed at a time;
- remat: the layer input plus the attention output and fp32 lse, c·T·(h + Hq·d) + 4·T·Hq per
  layer; the recomputed layer needs everything else of one layer;
- remat-offload: the remat tensors live in host memory; on the GPU there are at most two layers'
  worth (the one in use and the one being prefetched / still being copied out).

Transients, counted once: one layer's backward (its recomputed activations, the gradients
flowing through it, the distributed attention's buffers: fp32 accumulators, in-flight copies of
K/V and of remote queries and results) and the chunked loss (one chunk of logits, fp32 gradient
of the head).
"""
from __future__ import annotations

from lctrain.config.schema import CHECKPOINTING_POLICIES as POLICIES
from lctrain.memory import lora as lora_model
from lctrain.memory.arch import Architecture


def layer_saved(arch: Architecture, tokens: int, c: int,
                lora: lora_model.LoraShape | None = None) -> int:
    """Bytes one decoder layer saves for its backward without checkpointing (a LoRA run's
    frozen weights keep less: `lctrain.memory.lora.layer_saved`)."""
    if lora is not None:
        return lora_model.layer_saved(arch, tokens, c, lora)
    t, h = tokens, arch.hidden_size
    norms = 2 * ((4 + 2 * c) * t * h + 4 * t)
    qkv = c * t * (arch.q_width + 2 * arch.kv_width)
    attn_out = c * t * arch.q_width + 4 * t * arch.num_heads
    mlp = 4 * c * t * arch.intermediate_size
    return norms + qkv + attn_out + mlp


def remat_kept(arch: Architecture, tokens: int, c: int) -> int:
    """Bytes remat keeps per layer: the layer input, the attention output and its fp32 lse."""
    return c * tokens * (arch.hidden_size + arch.q_width) + 4 * tokens * arch.num_heads


def saved_activations(arch: Architecture, tokens: int, c: int, policy: str,
                      lora: lora_model.LoraShape | None = None) -> int:
    """Bytes held on the GPU between the forward and the backward, all layers together
    (plus the final norm, whose output feeds the loss)."""
    layers = arch.num_layers
    frozen_norm = lora is not None and "norm" not in lora.trainable  # keeps no normalised value
    final_norm = (4 + c * (1 + (not frozen_norm))) * tokens * arch.hidden_size
    if policy == "none":
        return layers * layer_saved(arch, tokens, c, lora) + final_norm
    if policy == "full":
        return layers * c * tokens * arch.hidden_size + final_norm
    if policy == "remat":
        return layers * remat_kept(arch, tokens, c) + final_norm
    if policy == "remat-offload":
        return min(2, layers) * remat_kept(arch, tokens, c) + final_norm
    raise ValueError(f"unknown checkpointing policy {policy!r}; choose one of {', '.join(POLICIES)}")


def host_offload(arch: Architecture, tokens: int, c: int, policy: str) -> int:
    """Pinned host bytes per GPU (per training process) that remat-offload parks (0 otherwise):
    every layer's remat tensors. The host must hold this times the processes per machine."""
    return arch.num_layers * remat_kept(arch, tokens, c) if policy == "remat-offload" else 0


def layer_backward(arch: Architecture, tokens: int, c: int, policy: str, cp: int,
                   lora: lora_model.LoraShape | None = None) -> int:
    """Peak bytes of one layer's backward beyond the saved activations.

    The MLP half runs first, with the whole recomputed layer alive (checkpointing) plus the
    residual-stream gradients and the MLP's activation gradients; then the attention half, when
    the recomputed MLP and second norm are gone but the attention's buffers and gradients are
    live. The larger of the two counts.
    """
    t, h = tokens, arch.hidden_size
    norm = (4 + 2 * c) * t * h + 4 * t
    qkv = c * t * (arch.q_width + 2 * arch.kv_width)
    out_lse = c * t * arch.q_width + 4 * t * arch.num_heads
    residual_grads = 2 * c * t * h
    if policy == "none":
        recomputed = 0
    elif policy == "full":
        recomputed = layer_saved(arch, tokens, c, lora)
    else:  # remat and remat-offload recompute all but the attention output and lse
        recomputed = layer_saved(arch, tokens, c, lora) - out_lse
    mlp_phase = recomputed + residual_grads + 3 * c * t * arch.intermediate_size
    attn_recomputed = 0 if policy == "none" else norm + qkv + (out_lse if policy == "full" else 0)
    attn_phase = (attn_recomputed + attention_workspace(arch, tokens, c, cp) + residual_grads
                  + c * t * arch.q_width)
    return max(mlp_phase, attn_phase)


def attention_workspace(arch: Architecture, tokens: int, c: int, cp: int) -> int:
    """Buffers of the (distributed) attention of one layer, the larger of forward and backward.

    Forward: fp32 output accumulator; with cp > 1 also double buffers of the next K/V block and
    of remote queries, and a received partial output. Backward: fp32 dq/dk/dv accumulators and
    the gradient of the output; with cp > 1 double buffers of K/V and of the remote
    (q, dout, out) triples. (The executor keeps partial results instead of accumulating them,
    but folds them into float32 before they exceed these accumulators plus one result, so the
    bound holds: measured peaks were unchanged at 64K and 128K on 2 x H200.)
    """
    t = tokens
    q, kv = t * arch.q_width, t * arch.kv_width
    forward = 4 * q + 4 * t * arch.num_heads
    backward = 4 * (q + 2 * kv) + c * q
    if cp > 1:
        forward += 2 * 2 * c * kv + 2 * c * q + c * q
        backward += 2 * 2 * c * kv + 2 * 3 * c * q + 4 * 2 * kv
    return max(forward, backward)


def loss_workspace(arch: Architecture, tokens: int, c: int, chunk_tokens: int,
                   head_grad: bool = True) -> int:
    """Chunked cross-entropy (lctrain.train.loss): one chunk of logits in the compute dtype and in
    fp32 plus its gradient in the compute dtype, the head-weight gradient as an fp32
    accumulator and one chunk's contribution (not for a frozen head, ``head_grad`` False), and
    the hidden-state gradient."""
    chunk = min(chunk_tokens, tokens)
    vh = arch.vocab_size * arch.hidden_size
    logits = chunk * arch.vocab_size * (c + 4 + c)
    return logits + vh * (4 + c) * head_grad + c * tokens * arch.hidden_size
