"""The model config a run trains: folder + overrides, RoPE spellings, and what is refused.

- overrides merge into the folder's config.json (RoPE key by key, or replaced on a new
  rope_type), in both spellings, and may not change the weights;
- the model built from them carries the new RoPE settings and ``max_position_embeddings`` into
  a saved config, and computes what plain transformers computes from a config.json edited by
  hand to the same settings;
- attention features lctrain cannot honour are refused before any weight loads, naming the
  setting as the model's config.json does; the attention call refuses them too when it runs.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from lctrain.config import load_recipe
from lctrain.errors import ConfigError, UserError
from lctrain.model import (
    check_model,
    check_model_config,
    load_model,
    register_attention,
    resolve_config,
)
from lctrain.model.load import fold_rope_spellings, merge_overrides
from model_folders import make_model_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    seed = int(torch.randint(0, 2**31, ()))
    return {"llama3": make_model_folder(root, "llama3", tokenizer=False, seed=seed),
            "mistral128": make_model_folder(root, "mistral", tokenizer=False, sliding_window=128,
                                            name="mistral128", seed=seed),
            "gpt2": make_model_folder(root, "gpt2", tokenizer=False, attn_pdrop=0.1, seed=seed),
            "qwen2": make_model_folder(root, "qwen2", tokenizer=False, seed=seed)}


def _config(model_type: str, **fields):
    from transformers import AutoConfig

    small = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128}
    return AutoConfig.for_model(model_type, **{**small, **fields})


def test_rope_spellings_fold_into_rope_parameters():
    assert fold_rope_spellings({"rope_theta": 1e6, "x": 1}, where="w") == {
        "x": 1, "rope_parameters": {"rope_theta": 1e6}}
    assert fold_rope_spellings({"rope_scaling": {"type": "linear", "factor": 2.0}}, where="w") == {
        "rope_parameters": {"rope_type": "linear", "factor": 2.0}}
    assert fold_rope_spellings({"rope_scaling": None}, where="w") == {
        "rope_parameters": {"rope_type": "default"}}
    both = {"rope_theta": 1.0, "rope_scaling": None,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 2.0}}
    with pytest.raises(ConfigError, match="rope_type twice.*keep rope_parameters"):
        fold_rope_spellings(both, where="w")
    assert fold_rope_spellings(both, where="w", strict=False) == {  # a config.json: as transformers
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 2.0}}


def test_overrides_merge_rope_by_type():
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0}
    base = {"hidden_size": 8, "rope_parameters": llama3}
    same = merge_overrides(base, {"rope_parameters": {"factor": 16.0}, "hidden_size": 8})
    assert same["rope_parameters"] == {**llama3, "factor": 16.0}
    other = merge_overrides(base, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    assert other["rope_parameters"] == {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5}
    old = merge_overrides({"rope_theta": 1e4, "rope_scaling": None}, {"rope_theta": 2e4})
    assert old == {"rope_parameters": {"rope_type": "default", "rope_theta": 2e4}}
    layered = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    merged = merge_overrides({"rope_parameters": layered},
                             {"rope_parameters": {"full_attention": {"rope_theta": 2e6}}})
    assert merged["rope_parameters"] == {**layered, "full_attention": {
        "rope_type": "default", "rope_theta": 2e6}}
    assert base["rope_parameters"] is llama3 and llama3["factor"] == 8.0  # inputs untouched


def test_overrides_may_not_change_the_weights(folders):
    path = str(folders["llama3"])
    same = resolve_config(path, {"hidden_size": 64, "num_key_value_heads": 2, "rms_norm_eps": 1e-3})
    assert same.rms_norm_eps == 1e-3 and same.hidden_size == 64
    for change, first in (({"hidden_size": 96}, "hidden_size"),
                          ({"tie_word_embeddings": True}, "tie_word_embeddings"),
                          ({"num_key_value_heads": 4, "rope_theta": 1.0}, "num_key_value_heads")):
        with pytest.raises(ConfigError, match=rf"overrides {first}.*change the weights"):
            resolve_config(path, change)
    with pytest.raises(ConfigError, match="'mistral' but the model .* is a 'llama'"):
        resolve_config(path, {"model_type": "mistral"})
    with pytest.raises(ConfigError, match="placeholder '<folder of Llama-3.1-8B>'.*model.path"):
        resolve_config("<folder of Llama-3.1-8B>", None)


def _edited_copy(folder, dest, drop=(), **fields):
    """A copy of ``folder`` whose config.json has ``fields`` and lacks the keys in ``drop``."""
    shutil.copytree(folder, dest)
    config = json.loads((dest / "config.json").read_text())
    for old in ("rope_theta", "rope_scaling", *drop):
        config.pop(old, None)
    config.update(fields)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_extended_model_saves_its_rope_and_matches_an_edited_folder(folders, tmp_path):
    """dynamic NTK past the native length on one process (where it is exact), saved and
    compared with plain transformers reading a config.json that states the same."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = {"rope_scaling": {"type": "dynamic", "factor": 4.0}, "max_position_embeddings": 64}
    model = load_model(str(folders["llama3"]), config=overrides, seed=0, seq_len=200)
    rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 500000.0}
    model.save_pretrained(tmp_path / "saved")
    saved = AutoConfig.from_pretrained(tmp_path / "saved")
    assert saved.rope_parameters == rope and saved.max_position_embeddings == 64
    edited = _edited_copy(folders["llama3"], tmp_path / "edited", rope_parameters=rope,
                          max_position_embeddings=64)
    eager = AutoModelForCausalLM.from_pretrained(edited, attn_implementation="eager").eval()
    ids = torch.randint(0, 400, (1, 200))
    with torch.no_grad():
        got, want = model.eval()(input_ids=ids).logits, eager(input_ids=ids).logits
        assert (got - want).abs().max() < 1e-4
        unscaled = AutoModelForCausalLM.from_pretrained(folders["llama3"]).eval()
        assert (unscaled(input_ids=ids).logits - want).abs().max() > 1e-2  # scaling mattered


def test_window_shorter_than_the_sequence_is_refused_before_and_during_training(folders):
    path = folders["mistral128"]
    cfg = load_recipe(None, [f"model.path={path}", "model.config=null", "data.tokenizer=null"],
                      seq_len=512)
    with pytest.raises(ConfigError, match=r"sliding_window is 128 tokens, shorter than the "
                                          r"512-token.*sliding_window=null"):
        check_model(cfg)
    assert load_model(str(path), config=None, seed=0, seq_len=128)  # the window covers 128
    fixed = load_model(str(path), config={"sliding_window": None}, seed=0, seq_len=512)
    assert fixed.config.sliding_window is None
    model = load_model(str(path), config=None, seed=0)  # no length given: the call checks
    with pytest.raises(ConfigError, match="sliding_window is 128 tokens, shorter than the 256"):
        model(input_ids=torch.randint(0, 400, (1, 256)))
    model(input_ids=torch.randint(0, 400, (1, 128)))


def test_qwen_window_follows_use_sliding_window_as_written(folders, tmp_path):
    """As Qwen2.5's own config.json: a window stated, switched off by use_sliding_window."""
    path = str(_edited_copy(folders["qwen2"], tmp_path / "qwen", sliding_window=64,
                            use_sliding_window=False, max_window_layers=2, drop=["layer_types"]))
    assert check_model_config(resolve_config(path, None), seq_len=256) == []
    switched = resolve_config(path, {"use_sliding_window": True, "max_window_layers": 0})
    with pytest.raises(ConfigError, match="sliding_window is 64"):
        check_model_config(switched, seq_len=256)


def test_attention_dropout_is_named_as_the_family_names_it(folders):
    path = folders["gpt2"]
    cfg = load_recipe(None, [f"model.path={path}", "model.config=null", "data.tokenizer=null"],
                      seq_len=256)
    with pytest.raises(ConfigError, match=r"attn_pdrop is 0.1 .*model.config.attn_pdrop=0"):
        check_model(cfg)
    assert load_model(str(path), config={"attn_pdrop": 0.0}, seed=0, seq_len=256)
    from transformers import AutoModelForCausalLM  # built around lctrain's checks: the call

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=register_attention())
    with pytest.raises(ConfigError, match="attn_pdrop is 0.1"):
        model.train()(input_ids=torch.randint(0, 400, (1, 32)))


@pytest.mark.parametrize("model_type, fields, words", [
    ("gemma2", {"attn_logit_softcapping": 50.0, "final_logit_softcapping": None},
     ["attn_logit_softcapping is 50.0", "attention scores"]),
    ("gemma2", {"attn_logit_softcapping": None, "final_logit_softcapping": 30.0},
     ["final_logit_softcapping is 30.0", "output logits"]),
    ("cohere", {}, ["logit_scale is 0.0625"]),
    ("falcon", {}, ["FalconForCausalLM", "attention interface"]),
    ("bloom", {}, ["BloomForCausalLM", "attention interface"]),
    ("t5", {}, ["encoder-decoder"]),
    ("llama", {"alibi": True}, ["alibi selects ALiBi"]),
    ("gemma", {"use_bidirectional_attention": True}, ["use_bidirectional_attention is True",
                                                      "causal only"]),
    ("llama", {"attention_dropout": 0.05}, ["attention_dropout is 0.05"]),
    ("minimax", {}, ["layer_types include linear_attention"]),
    ("llama4_text", {"attention_chunk_size": 64, "no_rope_layers": [1, 1]},
     ["attention_chunk_size is 64"]),
    # its decoder layers drop cp_context: documents and cp ranks would attend across each other
    ("nemotron", {}, ["NemotronForCausalLM", "keywords", "document bounds"]),
    # HF adds the router's load-balancing loss to the loss; lctrain's loss reads the head only
    ("mixtral", {"output_router_logits": True}, ["output_router_logits is True",
                                                 "model.config.output_router_logits=false"]),
])
def test_features_lctrain_cannot_honour_are_refused_by_name(model_type, fields, words):
    with pytest.raises(ConfigError) as info:
        check_model_config(_config(model_type, **fields), seq_len=256)
    for word in words:
        assert word in str(info.value)
    assert "\n" not in str(info.value)


def test_the_attention_call_refuses_soft_capping():
    from transformers import AutoModelForCausalLM

    config = _config("gemma2", attn_logit_softcapping=50.0, sliding_window=4096)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention())
    with pytest.raises(ConfigError, match="attn_logit_softcapping is 50.0"):
        model(input_ids=torch.randint(0, 128, (1, 16)))


def test_positions_past_the_native_length():
    warnings = check_model_config(_config("llama", max_position_embeddings=1024), seq_len=4096)
    assert len(warnings) == 1
    assert "past the model's max_position_embeddings 1024" in warnings[0]
    assert "rope_type: yarn, factor: 4.0, original_max_position_embeddings: 1024" in warnings[0]
    assert "model.config.max_position_embeddings=4096" in warnings[0]
    scaled = _config("llama", max_position_embeddings=1024,
                     rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})
    assert "RoPE linear" in check_model_config(scaled, seq_len=4096)[0]
    assert check_model_config(scaled, seq_len=1024) == []
    with pytest.raises(ConfigError, match="past the 1024 positions the model learned "
                                          r"\(n_positions in its config.json\)"):
        check_model_config(_config("gpt2", n_positions=1024, attn_pdrop=0.0), seq_len=2048)
    dynamic = _config("llama", max_position_embeddings=1024,
                      rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4})
    assert check_model_config(dynamic, seq_len=4096, cp=1)  # one rank: exact, a warning only
    assert check_model_config(dynamic, seq_len=1024, cp=2) == []  # within the native length
    with pytest.raises(ConfigError, match=r"rope_type dynamic .* 2 ranks .*rope_type: default, "
                                          r"rope_theta: \d"):
        check_model_config(dynamic, seq_len=4096, cp=2)


def test_model_folder_mistakes(folders, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        load_recipe(None, [f"model.path={empty}", "data.tokenizer=null"])
    shutil.copy(folders["llama3"] / "config.json", empty / "config.json")
    cfg = load_recipe(None, [f"model.path={empty}", "model.config=null", "data.tokenizer=null"])
    with pytest.raises(UserError, match="has a config.json but no weights"):
        check_model(cfg)
    with pytest.raises(ConfigError, match="model.path is not set and model.config has no "
                                          "model_type"):
        load_recipe(None, ["model.config={rope_theta: 1.0}"])
