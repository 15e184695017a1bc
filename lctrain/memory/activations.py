"""Bytes of activations and transient buffers of one GPU, per checkpointing policy.

Notation: T tokens on this GPU (batch × seq_len / cp), h hidden, I intermediate, Hq / Hkv heads,
d head dim, c bytes of the compute dtype (2 for bf16), L layers, V vocabulary.

What one transformers Llama-style decoder layer saves for its backward (no checkpointing):

    each RMSNorm (two)   fp32 upcast of its input 4·T·h (pow / mul save it), the normalised
                         value before the weight c·T·h, its output c·T·h (saved by the next
                         linears), rsqrt 4·T                                   -> (4 + 2c)·T·h
                         fused (`Architecture.fused_norms`, on GPUs): its input c·T·h, its
                         output c·T·h, a float32 scale 4·T                     -> 2c·T·h
    q, k, v after RoPE   c·T·(Hq + 2·Hkv)·d (RoPE's muls save only cos / sin, shared)
    attention out, lse   c·T·Hq·d (also o_proj's input) + 4·T·Hq
    gated MLP            gate, SiLU(gate), up, SiLU(gate)·up: 4·c·T·I
                         fused (`Architecture.fused_mlp`, on GPUs): no SiLU(gate)  -> 3·c·T·I

Policies (see lctrain.parallel.activation_checkpoint):

- none: all of the above for every layer;
- full: each layer's input c·T·h; in the backward one layer is recomputed at a time;
- remat: the layer input plus the attention output and fp32 lse, c·T·(h + Hq·d) + 4·T·Hq per
  layer; the recomputed layer needs everything else of one layer;
- remat-offload: the remat tensors live in host memory; on the GPU there are at most two layers'
  worth (the one in use and the one being prefetched / still being copied out);
- auto: each layer has its own policy (`lctrain.config.tiers`): none, or remat or full with
  its kept tensors on the GPU or in host memory (`lctrain.memory.tiers` places them); the GPU
  holds, at the worst layer of the backward, the kept tensors of the layers not yet reached
  plus two parked layers' (`kept_during_layers`).

Tiled layers (``tile_tokens`` < T, `lctrain.parallel.tiling`): the final norm keeps only its
input (c·T·h); in each layer the MLP and both norms keep only their inputs — the layer input
x, h1 = x + attention and the second norm's output, 3·c·T·h, or 2·c·T·h where the second norm
runs inside the MLP's tiles (`Architecture.norm_in_tiles`) —
plus the first norm's output (kept by q, k, v), and their backward needs one tile's worth of
the MLP (7·c·n·I for n tile tokens, 6·c·n·I fused; with the norm, its output and gradient)
and float32 sums of the MLP's weight gradients. Beside the recomputed layer, the MLP half of
the backward holds two (T × h) gradients (of the layer output and of the MLP input) and the attention half the residual
stream's gradient and the attention output's (allocator traces of `lctrain bench step
--memory-trace` show exactly these).

Head groups (G, `lctrain_kernels` ``head_groups``): the attention's own buffers are those of
Hq/G heads, plus copies of one group's inputs and results and, in the backward, full-size
gradients written group by group. Where the projections run in the groups too
(`Architecture.grouped_attention`, `lctrain.model.grouped_attention`; not with LoRA), a layer
keeps no q, k or v (the block keeps its input, the attention output and the lse; with the norm
inside the block, `Architecture.norm_in_attention`, its input is the layer's, so the norm's
output is not kept), and its backward holds one group's q, k, v, their gradients, its share of
the output's gradient and the attention's buffers, beside the normalised input and its
full-size gradient.

Transients, counted once: one layer's backward (its recomputed activations, the gradients
flowing through it, the distributed attention's buffers: fp32 accumulators, in-flight copies of
K/V and of remote queries and results) and the chunked loss (one chunk of logits, fp32 gradient
of the head).
"""
from __future__ import annotations

from lctrain.config.training import CHECKPOINTING_POLICIES as POLICIES
from lctrain.config.tiers import OFFLOADED, per_layer
from lctrain.memory import lora as lora_model
from lctrain.memory.arch import Architecture


def tiled(tokens: int, tile_tokens: int) -> bool:
    """Whether a layer of ``tokens`` tokens runs its MLP and norms in tiles."""
    return 0 < tile_tokens < tokens


def grouped(arch: Architecture, lora: lora_model.LoraShape | None, head_groups: int) -> bool:
    """Whether the attention's projections run in head groups (see the module docstring)."""
    return arch.grouped_attention and head_groups > 1 and lora is None


def layer_saved(arch: Architecture, tokens: int, c: int,
                lora: lora_model.LoraShape | None = None, tile_tokens: int = 0,
                head_groups: int = 1) -> int:
    """Bytes one decoder layer saves for its backward without checkpointing (a LoRA run's
    frozen weights keep less: `lctrain.memory.lora.layer_saved`; tiled layers keep their
    inputs only; projections in head groups keep no q, k, v)."""
    t, h = tokens, arch.hidden_size
    in_groups = grouped(arch, lora, head_groups)
    in_block = in_groups and arch.norm_in_attention  # the first norm runs in the block
    qkv = 0 if in_groups else c * t * (arch.q_width + 2 * arch.kv_width)
    if tiled(tokens, tile_tokens):
        if lora is not None:
            return lora_model.tiled_layer_saved(arch, tokens, c, lora)
        kept = (2 + (not in_block) + (not arch.norm_in_tiles)) * c * t * h  # see above
        return kept + qkv + c * t * arch.q_width + 4 * t * arch.num_heads  # + the output
    if lora is not None:
        return lora_model.layer_saved(arch, tokens, c, lora)
    norms = norm_saved(arch, tokens, c) + (c * t * h if in_block else norm_saved(arch, tokens, c))
    attn_out = c * t * arch.q_width + 4 * t * arch.num_heads
    mlp = (3 if arch.fused_mlp else 4) * c * t * arch.intermediate_size  # gate, up, (SiLU,) product
    return norms + qkv + attn_out + mlp


def norm_saved(arch: Architecture, tokens: int, c: int) -> int:
    """Bytes one trained RMSNorm of a layer keeps with its output (see the module docstring)."""
    upcast = 0 if arch.fused_norms else 4
    return (upcast + 2 * c) * tokens * arch.hidden_size + 4 * tokens


def remat_kept(arch: Architecture, tokens: int, c: int) -> int:
    """Bytes remat keeps per layer: the layer input, the attention output and its fp32 lse."""
    return c * tokens * (arch.hidden_size + arch.q_width) + 4 * tokens * arch.num_heads


def input_kept(arch: Architecture, tokens: int, c: int) -> int:
    """Bytes full checkpointing keeps per layer: the layer input."""
    return c * tokens * arch.hidden_size


def kept_bytes(arch: Architecture, tokens: int, c: int, layer_policy: str,
               lora: lora_model.LoraShape | None = None, tile_tokens: int = 0,
               head_groups: int = 1) -> int:
    """What one layer of ``layer_policy`` (a `lctrain.config.tiers.LAYER_KINDS` name) keeps:
    everything its backward needs for ``none`` (`layer_saved`), nothing for a chained layer,
    whose input is rebuilt from the layer below."""
    if layer_policy == "none":
        return layer_saved(arch, tokens, c, lora, tile_tokens, head_groups)
    if layer_policy.startswith("remat"):
        return remat_kept(arch, tokens, c)
    return 0 if layer_policy == "chained" else input_kept(arch, tokens, c)


def layer_policies(arch: Architecture, policy: str, runs=None) -> list[str]:
    """Every layer's policy: ``runs`` (the ``auto`` placement) or the uniform ``policy``."""
    if runs is not None:
        return per_layer(runs)
    if policy == "none":
        return ["none"] * arch.num_layers
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} has no layer policies; choose one of "
                         f"{', '.join(POLICIES)} or give the layers' runs")
    return [policy] * arch.num_layers


def kept_at_each_layer(arch: Architecture, tokens: int, c: int, kinds: list[str],
                       lora: lora_model.LoraShape | None = None, tile_tokens: int = 0,
                       head_groups: int = 1, prefetch: bool = True) -> list[int]:
    """Bytes of kept tensors on the GPU while each layer's backward runs (layers of ``kinds``,
    in forward order; `kept_during_layers`); the largest, with the final norm's, is what is held
    between the forward and the backward."""
    kept = [kept_bytes(arch, tokens, c, k, lora, tile_tokens, head_groups) for k in kinds]
    return kept_during_layers(kept, [k in OFFLOADED for k in kinds], prefetch)


def kept_during_layers(kept: list[int], parked: list[bool], prefetch: bool = True) -> list[int]:
    """Bytes of kept tensors on the GPU while each layer's backward runs, the backward walking
    the layers from the last to the first: every GPU-kept layer not yet reached (the current
    one included), the parked layer in use (brought back) and, with ``prefetch``, the parked
    layer below the current one, whose copies back are under way (`lctrain.parallel.offload`:
    a layer's recompute starts the next one's). Layers in forward order."""
    during, on_gpu, below = [], 0, 0
    for nbytes, is_parked in zip(kept, parked):
        on_gpu += 0 if is_parked else nbytes
        during.append(on_gpu + (nbytes if is_parked else 0) + below)
        below = nbytes if is_parked and prefetch else below
    return during


def final_norm_saved(arch: Architecture, tokens: int, c: int,
                     lora: lora_model.LoraShape | None = None, tile_tokens: int = 0) -> int:
    """Bytes the final norm keeps for its backward (its output feeds the loss). They are freed
    when the loss's backward has passed through the norm, before any layer's backward."""
    if tiled(tokens, tile_tokens):  # the tiled final norm keeps its input only
        return c * tokens * arch.hidden_size
    if arch.fused_norms:  # its input and output (and a float32 scale per token)
        return 2 * c * tokens * arch.hidden_size + 4 * tokens
    frozen_norm = lora is not None and "norm" not in lora.trainable  # keeps no normalised value
    return (4 + c * (1 + (not frozen_norm))) * tokens * arch.hidden_size


def host_offload(arch: Architecture, tokens: int, c: int, policy: str, runs=None) -> int:
    """Pinned host bytes per GPU (per training process) of the offloaded layers (0 if none):
    their kept tensors. The host must hold this times the processes per machine."""
    if policy == "none" or (policy not in POLICIES and runs is None):
        return 0
    kinds = layer_policies(arch, policy, runs)
    return sum(kept_bytes(arch, tokens, c, k) for k in kinds if k in OFFLOADED)


def layer_backward(arch: Architecture, tokens: int, c: int, policy: str, cp: int,
                   lora: lora_model.LoraShape | None = None, tile_tokens: int = 0,
                   head_groups: int = 1) -> int:
    """Peak bytes of one layer's backward beyond the saved activations, for one layer of
    ``policy`` (none, or a layer's kind: remat and full, offloaded or not, or chained).

    The MLP half runs first, with the whole recomputed layer alive (checkpointing) plus the
    residual-stream gradients and the MLP's activation gradients; then the attention half, when
    the recomputed MLP and second norm are gone but the attention's buffers and gradients are
    live. The larger of the two counts.
    """
    if policy == "chained":  # a full layer whose input is rebuilt first, and held meanwhile
        return (layer_backward(arch, tokens, c, "full", cp, lora, tile_tokens, head_groups)
                + input_kept(arch, tokens, c))
    if tiled(tokens, tile_tokens):
        return _tiled_layer_backward(arch, tokens, c, policy, cp, lora, tile_tokens, head_groups)
    t, h = tokens, arch.hidden_size
    norm = norm_saved(arch, tokens, c)
    saved = layer_saved(arch, tokens, c, lora, head_groups=head_groups)
    out_lse = c * t * arch.q_width + 4 * t * arch.num_heads
    residual_grads = 2 * c * t * h
    if policy == "none":
        recomputed = 0
    elif policy.startswith("full"):
        recomputed = saved
    else:  # remat and remat-offload recompute all but the attention output and lse
        recomputed = saved - out_lse
    mlp_phase = recomputed + residual_grads + 3 * c * t * arch.intermediate_size
    return max(mlp_phase, residual_grads + _attention_phase(arch, tokens, c, policy, cp, lora,
                                                            head_groups, norm))


def _attention_phase(arch, tokens, c, policy, cp, lora, head_groups, recomputed_input) -> int:
    """The attention half of a layer's backward beside the residual stream's gradients: what
    the recompute left of the attention block's inputs (``recomputed_input``, the first norm's
    kept tensors; q, k, v; under full the output and lse), the attention's buffers and the
    gradient of the attention output. With the norm and the projections in head groups: the
    norm's output, which the block's backward makes again, one group's buffers
    (`grouped_workspace`) and the gradient of the norm's output, filled in place group by
    group; no q, k, v and no full-size gradient of the attention output."""
    t = tokens
    out_lse = c * t * arch.q_width + 4 * t * arch.num_heads
    full = out_lse if policy.startswith("full") else 0
    if grouped(arch, lora, head_groups):
        if arch.norm_in_attention:  # the block's backward makes the norm's output again
            normed = norm_saved(arch, tokens, c) - c * t * arch.hidden_size  # (input: kept)
        else:
            normed = 0 if policy == "none" else recomputed_input
        return (normed + full + grouped_workspace(arch, tokens, c, cp, head_groups)
                + c * t * arch.hidden_size)
    recomputed = 0 if policy == "none" else (
        recomputed_input + full + c * t * (arch.q_width + 2 * arch.kv_width))
    return recomputed + attention_workspace(arch, tokens, c, cp, head_groups) + c * t * arch.q_width


def _tiled_layer_backward(arch, tokens, c, policy, cp, lora, tile_tokens, head_groups) -> int:
    """`layer_backward` of a tiled layer: the layer input is the one the checkpoint keeps, the
    MLP's backward holds its input gradient, one tile's recompute and gradients, and float32
    sums of its weight gradients (with one tile's gradient in the weights' dtype)."""
    t, h, n = tokens, arch.hidden_size, tile_tokens
    out_lse = c * t * arch.q_width + 4 * t * arch.num_heads
    saved = layer_saved(arch, tokens, c, lora, tile_tokens, head_groups)
    x = c * t * h  # the layer input: kept by the checkpoint
    if policy == "none":
        recomputed = 0
    else:  # full recomputes the attention output too
        recomputed = saved - x - (0 if policy.startswith("full") else out_lse)
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
    """Buffers of the (distributed) attention of one layer, the larger of forward and backward.

    cp > 1, forward: fp32 output accumulator; double buffers of the next K/V block and of remote
    queries, and a received partial output. Backward: fp32 dq/dk/dv accumulators and the
    gradient of the output; double buffers of K/V and of the remote (q, dout, out) triples. (The
    executor keeps partial results instead of accumulating them, but folds them into float32
    before they exceed these accumulators plus one result, so the bound holds.)

    cp = 1: one block straight through the backend, no accumulators: the lse in the forward; in
    the backward the kernel's dq, dk, dv (already laid out as the layer wants them) and its
    workspace: a float32 dq accumulator, or with grouped-query attention float32 dK/dV of every
    query head, which it sums per group (two float32 copies of q). Both are what cuDNN's and
    FlashAttention's backward in torch allocate beside their results (measured with
    ``torch.cuda.max_memory_allocated`` around one call; the allocator traces of `lctrain bench
    step --memory-trace` show the same at a layer's peak).

    Both: K/V are never repeated for grouped-query attention; every kernel reads them with
    their own heads and returns dK/dV summed per group. With cp > 1 the float32 dK/dV per query
    head of a block's kernel are counted too. With G head groups all of that is per group (÷ G),
    plus the copies of one group's inputs and results, and the full-size gradients filled group
    by group.
    """
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
    """The backward buffers of one head group of an attention block whose projections run in
    the groups (`lctrain.model.grouped_attention`): the attention's own (`attention_workspace`
    of all heads, ÷ G), the group's rotated q and k and its v, and copies of its rows of the
    output, of the output's gradient and of the lse."""
    t = tokens
    q, kv = t * arch.q_width, t * arch.kv_width
    group_io = c * (q + 2 * kv) + 2 * c * q + 4 * t * arch.num_heads
    return (attention_workspace(arch, tokens, c, cp) + group_io) // head_groups


def loss_workspace(arch: Architecture, tokens: int, c: int, chunk_tokens: int,
                   head_grad: bool = True) -> int:
    """Chunked cross-entropy (lctrain.train.loss): one chunk of logits in the compute dtype, the
    head-weight gradient as an fp32 accumulator (not for a frozen head, ``head_grad`` False),
    and the hidden-state gradient. With its kernel (``arch.fused_loss``) the logits' gradient
    is written over them and the product adds into the accumulator; without, the chunk also
    has an fp32 copy and a gradient in the compute dtype, and the head's product one chunk's
    contribution in the compute dtype."""
    chunk = min(chunk_tokens, tokens)
    vh = arch.vocab_size * arch.hidden_size
    grad_h = c * tokens * arch.hidden_size
    if arch.fused_loss:
        return chunk * arch.vocab_size * c + vh * 4 * head_grad + grad_h
    return chunk * arch.vocab_size * (c + 4 + c) + vh * (4 + c) * head_grad + grad_h
