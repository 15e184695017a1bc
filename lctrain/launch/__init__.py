"""Processes: how the ranks of a run or an evaluation start, are watched, stop and fail.

`launcher.dispatch` starts the ranks and each runs `rank.worker_main`; training and evaluation
both use it, and nothing here imports either.
"""
