"""Bytes of activations and transient buffers of one GPU by layer kind, tiles and head groups
(what each keeps: docs/internals.md, Memory)."""
from __future__ import annotations

from lctrain.memory import adapters as lora_model
from lctrain.memory.arch import Architecture


def tiled(tokens: int, tile_tokens: int) -> bool:
    """Whether a layer of ``tokens`` tokens runs its MLP and norms in tiles."""
    return 0 < tile_tokens < tokens


def grouped(arch: Architecture, lora: lora_model.LoraShape | None, head_groups: int) -> bool:
    """Whether the attention's projections run in head groups (docs/internals.md)."""
    return arch.grouped_attention and head_groups > 1 and lora is None


def layer_saved(arch: Architecture, tokens: int, c: int,
                lora: lora_model.LoraShape | None = None, tile_tokens: int = 0,
                head_groups: int = 1) -> int:
    """Bytes a layer keeps for its backward unchecked (less with LoRA, tiles or head groups)."""
    t, h = tokens, arch.hidden_size
    in_groups = grouped(arch, lora, head_groups)
    in_block = in_groups and arch.norm_in_attention  # the first norm runs in the block
    qkv = 0 if in_groups else c * t * (arch.q_width + 2 * arch.kv_width)
    if tiled(tokens, tile_tokens):
        if lora is not None:
            return lora_model.tiled_layer_saved(arch, tokens, c, lora)
        kept = (2 + (not in_block) + (not arch.norm_in_tiles)) * c * t * h  # see above
        return kept + qkv + out_lse(arch, t, c)
    if lora is not None:
        return lora_model.layer_saved(arch, tokens, c, lora)
    norms = norm_saved(arch, tokens, c) + (c * t * h if in_block else norm_saved(arch, tokens, c))
    mlp = (3 if arch.fused_mlp else 4) * c * t * arch.intermediate_size  # gate, up, (SiLU,) product
    return norms + qkv + out_lse(arch, t, c) + mlp


def norm_saved(arch: Architecture, tokens: int, c: int) -> int:
    """Bytes one trained RMSNorm of a layer keeps with its output (docs/internals.md)."""
    upcast = 0 if arch.fused_norms else 4
    return (upcast + 2 * c) * tokens * arch.hidden_size + 4 * tokens


def out_lse(arch: Architecture, tokens: int, c: int) -> int:
    """Bytes of the attention output and its fp32 log-sum-exp."""
    return c * tokens * arch.q_width + 4 * tokens * arch.num_heads


def remat_kept(arch: Architecture, tokens: int, c: int) -> int:
    """Bytes remat keeps per layer: the layer input, the attention output and its lse."""
    return c * tokens * arch.hidden_size + out_lse(arch, tokens, c)


def input_kept(arch: Architecture, tokens: int, c: int) -> int:
    """Bytes full checkpointing keeps per layer: the layer input."""
    return c * tokens * arch.hidden_size


def kept_bytes(arch: Architecture, tokens: int, c: int, kind: str,
               lora: lora_model.LoraShape | None = None, tile_tokens: int = 0,
               head_groups: int = 1) -> int:
    """What one layer of ``kind`` keeps for its backward (everything for ``none``)."""
    if kind == "none":
        return layer_saved(arch, tokens, c, lora, tile_tokens, head_groups)
    return remat_kept(arch, tokens, c) if kind == "remat" else input_kept(arch, tokens, c)


def kept_during_layers(kept: list[int], parked: list[bool]) -> list[int]:
    """Kept GPU bytes at each layer's backward: GPU layers not yet passed, two parked ones."""
    during, on_gpu, below = [], 0, 0
    for nbytes, is_parked in zip(kept, parked):
        on_gpu += 0 if is_parked else nbytes
        during.append(on_gpu + (nbytes if is_parked else 0) + below)
        below = nbytes if is_parked else below
    return during


def final_norm_saved(arch: Architecture, tokens: int, c: int,
                     lora: lora_model.LoraShape | None = None, tile_tokens: int = 0) -> int:
    """Bytes the final norm keeps (freed once the loss's backward passed it)."""
    if tiled(tokens, tile_tokens):  # the tiled final norm keeps its input only
        return c * tokens * arch.hidden_size
    if arch.fused_norms:  # its input and output (and a float32 scale per token)
        return 2 * c * tokens * arch.hidden_size + 4 * tokens
    frozen_norm = lora is not None and "norm" not in lora.trainable  # keeps no normalised value
    return (4 + c * (1 + (not frozen_norm))) * tokens * arch.hidden_size


def host_offload(arch: Architecture, tokens: int, c: int, kinds, parked) -> int:
    """Pinned host bytes per training process of the parked layers' kept tensors."""
    return sum(kept_bytes(arch, tokens, c, k) for k, p in zip(kinds, parked) if p)


def layer_backward(arch: Architecture, tokens: int, c: int, policy: str, cp: int,
                   lora: lora_model.LoraShape | None = None, tile_tokens: int = 0,
                   head_groups: int = 1) -> int:
    """Peak bytes of a ``policy``-kind layer's backward: the larger of its MLP and attention halves."""
    if tiled(tokens, tile_tokens):
        return _tiled_layer_backward(arch, tokens, c, policy, cp, lora, tile_tokens, head_groups)
    t = tokens
    saved = layer_saved(arch, tokens, c, lora, head_groups=head_groups)
    residual_grads = 2 * c * t * arch.hidden_size
    # remat recomputes all but the attention output and lse
    recomputed = {"none": 0, "full": saved}.get(policy, saved - out_lse(arch, t, c))
    mlp_phase = recomputed + residual_grads + 3 * c * t * arch.intermediate_size
    return max(mlp_phase, residual_grads + _attention_phase(
        arch, tokens, c, policy, cp, lora, head_groups, norm_saved(arch, tokens, c)))


def _attention_phase(arch, tokens, c, policy, cp, lora, head_groups, recomputed_input) -> int:
    """The attention half of a layer's backward: recomputed inputs, q, k, v, buffers, gradients."""
    t = tokens
    full = out_lse(arch, t, c) if policy == "full" else 0
    if grouped(arch, lora, head_groups):
        x_grad = c * t * arch.hidden_size  # the block's input gradient, summed over the groups
        norm_backward = 0
        if arch.norm_in_attention:  # the block's backward makes the norm's output again
            normed = norm_saved(arch, tokens, c) - x_grad  # (input: kept)
            # and runs the norm's backward after the groups: its input gradient beside theirs
            norm_backward = normed + full + 2 * x_grad
        else:
            normed = 0 if policy == "none" else recomputed_input
        return max(normed + full + grouped_workspace(arch, tokens, c, cp, head_groups) + x_grad,
                   norm_backward)
    recomputed = 0 if policy == "none" else (
        recomputed_input + full + c * t * (arch.q_width + 2 * arch.kv_width))
    return recomputed + attention_workspace(arch, tokens, c, cp, head_groups) + c * t * arch.q_width


def _tiled_layer_backward(arch, tokens, c, policy, cp, lora, tile_tokens, head_groups) -> int:
    """`layer_backward` of a tiled layer: one tile's recompute and gradients."""
    t, h, n = tokens, arch.hidden_size, tile_tokens
    saved = layer_saved(arch, tokens, c, lora, tile_tokens, head_groups)
    x = c * t * h  # the layer input: kept by the checkpoint
    # full recomputes the attention output too
    recomputed = 0 if policy == "none" else saved - x - (policy != "full") * out_lse(arch, t, c)
    mlp_weights = (lora_model.layer_trainable(arch, lora) if lora is not None
                   else 3 * h * arch.intermediate_size)
    norm_tile = 2 * c * n * h if arch.norm_in_tiles else 0  # its output and input gradient
    mlp_tile = (6 if arch.fused_mlp else 7) * c * n * arch.intermediate_size + c * n * h + (
        (4 + c) * mlp_weights) + norm_tile
    mlp_phase = recomputed + 2 * c * t * h + mlp_tile  # d(layer output), d(MLP input)
    return max(mlp_phase, c * t * h + _attention_phase(  # d(residual) beside the attention half
        arch, tokens, c, policy, cp, lora, head_groups, c * t * h))


def attention_workspace(arch: Architecture, tokens: int, c: int, cp: int,
                        head_groups: int = 1) -> int:
    """Buffers of one layer's (distributed) attention, per group with head groups."""
    t, g = tokens, head_groups
    q, kv, lse = t * arch.q_width, t * arch.kv_width, 4 * t * arch.num_heads
    gqa_workspace = 2 * 4 * q if arch.num_kv_heads < arch.num_heads else 0
    if cp > 1:
        forward = 4 * q + lse + 2 * 2 * c * kv + 2 * c * q + c * q
        backward = (4 * (q + 2 * kv) + c * q + 2 * 2 * c * kv + 2 * 3 * c * q + 4 * 2 * kv
                    + gqa_workspace)
    else:
        forward = lse
        backward = c * (q + 2 * kv) + (gqa_workspace or 4 * q)
    if g == 1:
        return max(forward, backward)
    forward = forward // g + (c * (2 * q + 2 * kv) + lse) // g
    backward = backward // g + c * (q + 2 * kv) + (3 * c * q + 2 * c * kv + lse) // g
    return max(forward, backward)


def grouped_workspace(arch: Architecture, tokens: int, c: int, cp: int, head_groups: int) -> int:
    """Backward buffers of one head group of a grouped attention block."""
    t = tokens
    q, kv = t * arch.q_width, t * arch.kv_width
    group_io = c * (q + 2 * kv) + 2 * c * q + 4 * t * arch.num_heads
    return (attention_workspace(arch, tokens, c, cp) + group_io) // head_groups


def loss_workspace(arch: Architecture, tokens: int, c: int, chunk_tokens: int,
                   head_grad: bool = True) -> int:
    """The loss's working set: Liger's fused linear cross-entropy (``arch.fused_loss``), whose
    chunks hold about the hidden states' size of logits, with the head's float32 gradient and its
    copy in the compute dtype; else the chunked cross-entropy's, with float32 copies."""
    vh = arch.vocab_size * arch.hidden_size
    grad_h = c * tokens * arch.hidden_size
    if arch.fused_loss:
        rows = -(-tokens // -(-arch.vocab_size // arch.hidden_size))
        chunk = min(tokens, 1 << (rows - 1).bit_length())
        return max(chunk * arch.vocab_size, vh * head_grad) * c + vh * 4 * head_grad + grad_h \
            + 4 * tokens  # the chunk's logits are gone when the head's gradient is cast
    chunk = min(chunk_tokens, tokens)
    return chunk * arch.vocab_size * (c + 4 + c) + vh * (4 + c) * head_grad + grad_h
