"""Processes: how the ranks of a run or an evaluation start, are watched, stop and fail.

`launcher.dispatch` starts the ranks (this process, or torch.distributed.run under an agent
process of its own); each rank runs `rank.worker_main`. Training and evaluation both use it;
nothing here imports either.
"""
