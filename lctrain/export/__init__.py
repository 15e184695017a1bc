"""Hugging Face export: a run's checkpoint becomes a folder that transformers (or peft) loads
with no lctrain installed — the whole model, a LoRA adapter, or the adapters merged in.

    result = export_run("runs/tiny", output="exported/tiny", dtype="float32")
"""
from lctrain.export.run import DTYPES, ExportResult, export_final, export_run
