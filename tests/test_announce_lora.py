"""The training banner of a LoRA run names the adapters' settings and how many parameters train,
counted on the model as built (one short real run, one CPU process)."""
from __future__ import annotations

import re

from lctrain.config import load_recipe

RANK, ALPHA = 4, 12.0
SMALL = {"data.seq_len": 128, "data.max_documents": 8, "train.warmup_steps": 1,
         "train.max_steps": 1, "train.loss_chunk_tokens": 48, "parallel.cp": 1,
         "parallel.attention_backend": "reference", "checkpoint.keep": 0}


def _banner(tmp_path, capsys, **sets) -> tuple[str, object]:
    from lctrain.train.runner import finetune

    values = {**SMALL, **sets}
    cfg = load_recipe(None, [f"{k}={v}" for k, v in values.items()],
                      output_dir=str(tmp_path / "run"))
    assert finetune(cfg, nproc=1) == 0
    out = capsys.readouterr().out
    start = out.index("lctrain finetune: ")
    return out[start:out.index("\n", out.index("\n", start) + 1)], cfg


def _base_parameters(cfg) -> int:
    """Parameters of the recipe's model without adapters, as transformers builds it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(cfg.model.config)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def test_a_lora_run_names_rank_alpha_targets_and_trainable_parameters(tmp_path, capsys):
    head, cfg = _banner(tmp_path, capsys, **{
        "lora.rank": RANK, "lora.alpha": ALPHA, "lora.target_modules": "[q_proj,v_proj]",
        "lora.trainable_modules": "[norm]"})
    line = head.splitlines()[1].strip()
    shape = cfg.model.config
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    kv = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    adapters = layers * RANK * ((hidden + hidden) + (hidden + kv))  # A: r × in, B: out × r
    trained = adapters + hidden  # and the final norm's trained copy
    total = _base_parameters(cfg) + trained  # peft keeps the norm's original beside the copy
    assert line.startswith(f"lora: rank {RANK}, alpha 12, dropout 0 on {2 * layers} linear "
                           "layers: q_proj, v_proj; trained in full: norm; "), line
    assert line.endswith(f"; {trained:,} trainable of {total:,} parameters "
                         f"({100 * trained / total:.3g} %)"), line


def test_all_linear_is_resolved_and_a_full_run_has_no_lora_line(tmp_path, capsys):
    head, _ = _banner(tmp_path / "lora", capsys, **{"lora.rank": 2})
    line = head.splitlines()[1].strip()
    assert re.match(r"lora: rank 2, alpha 4, dropout 0 on 14 linear layers: q_proj, k_proj, "
                    r"v_proj, o_proj, gate_proj, up_proj, down_proj \(all-linear\); "
                    r"[\d,]+ trainable of [\d,]+ parameters \([\d.]+ %\)$", line), line
    head, _ = _banner(tmp_path / "full", capsys)
    assert "lora" not in head
