"""Saved training state: checkpoints written atomically (`writer`) and read back (`reader`).

Training writes and resumes them; export and evaluation read them through `reader` alone.
"""
