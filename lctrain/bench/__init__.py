"""Benchmarks behind ``lctrain bench``: each bench module's ``run(...)`` returns a `BenchResult`
(`result`), timed by `timing`, shown by `views`, drawn and published by `publish`."""
