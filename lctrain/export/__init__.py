"""Hugging Face export: a run's checkpoint becomes a folder that transformers (or peft) loads
with no lctrain installed.

    from lctrain.export import export_run
    result = export_run("runs/tiny", output="exported/tiny", step=None, dtype="float32")
    # AutoModelForCausalLM.from_pretrained("exported/tiny"); AutoTokenizer.from_pretrained(...)

A run that trained every weight exports the model (config.json, generation_config.json,
safetensors shards of at most 5 GB with an index, tokenizer files). A LoRA run exports its
adapter (adapter_config.json, adapter_model.safetensors, for ``PeftModel.from_pretrained`` on
the base model), or with ``merge=True`` the base model with the adapters merged in. The model is
rebuilt from the run's config.yaml, so config.json is the trained model's, with every RoPE or
context-extension override. ``lctrain finetune`` writes ``final/`` this way after its last step
(`export_final`; ``checkpoint.export_final: false`` turns it off).
"""
from lctrain.export.run import DTYPES, ExportResult, export_final, export_run

__all__ = ["DTYPES", "ExportResult", "export_final", "export_run"]
