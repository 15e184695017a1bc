"""Saved training state: checkpoints written atomically (`writer`) and read back (`reader`)."""
