"""lctrain: fine-tune language models on very long contexts with DistFlashAttn."""

__version__ = "0.1.0"
