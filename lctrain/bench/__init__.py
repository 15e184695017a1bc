"""Benchmarks behind `lctrain bench`: local kernels, distributed attention, training steps.

Each module exposes ``run(...) -> BenchResult`` (see :mod:`lctrain.bench.result`): rows of
measurements with a correctness check first, rendered as a table, JSON and (where meaningful) a plot.
"""
