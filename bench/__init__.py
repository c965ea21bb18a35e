"""fp8core's benchmarks; the wheel ships this folder as ``fp8core.bench`` (``fp8core bench`` runs them, ``fp8core
info`` reads the GPU-verified stamp in ``results/``). Each ``bench_*.py`` is a script: run it by path."""
