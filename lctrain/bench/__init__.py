"""Benchmarks behind ``lctrain bench``: local kernels, distributed attention, training steps, tiles.

Each bench module exposes ``run(...) -> BenchResult``; they share one timing helper
(:mod:`lctrain.bench.timing`), one FLOP model (:mod:`lctrain.model.flops`) and one result
contract (:mod:`lctrain.bench.result`: rows and meta as JSON, read back by ``lctrain bench
report``). :mod:`lctrain.bench.views` says how each kind is shown, :mod:`lctrain.bench.plot`
draws it, :mod:`lctrain.bench.publish` prints, writes and plots it for the command line.

    kernel      one device's attention backends and peers (flex_attention), fwd / bwd TFLOP/s
    attention   the distributed attention per schedule on N ranks it launches, vs one GPU
    step        whole training steps of a recipe, at several lengths and configurations
    tiles       fixed tile configurations of lctrain's Triton kernels against the autotuned
"""
