"""A small transformers Llama switched in place to Liger-Kernel's forwards (`lctrain.model.fused`)
must keep its parameter objects and names and train like an unswitched copy of itself."""
import torch


def tiny_llama(**config):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         **config)
    return LlamaForCausalLM(config)


def check_fused_model_trains_alike(fuse, switched: int, device: str = "cuda"):
    """``fuse(model)`` switches ``switched`` modules (again when called twice) of a tiny Llama
    without touching its parameters, and the loss and every gradient stay the plain copy's.
    Returns the fused model."""
    plain = tiny_llama().to(device)
    fused = tiny_llama().to(device)
    fused.load_state_dict(plain.state_dict())
    params = {name: p for name, p in fused.named_parameters()}
    assert fuse(fused) == switched
    assert fuse(fused) == switched  # idempotent
    assert {name: p for name, p in fused.named_parameters()} == params  # same objects, names
    ids = torch.randint(0, 96, (2, 24), device=device)
    losses = []
    for model in (plain, fused):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    assert torch.allclose(losses[0], losses[1], rtol=1e-5, atol=0)
    grads = dict(plain.named_parameters())
    for name, p in fused.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, rtol=1e-3, atol=1e-5), name
    return fused
