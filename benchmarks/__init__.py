"""The measurements behind README's numbers: each module is one benchmark, run from the
repository's root as a module (``.venv/bin/python -m benchmarks.NAME --help`` for its options),
writing ``benchmarks/results/NAME.*``. They use the product (edge_un, converters, quant, service)
from outside, through its public API, as a user would.

Nothing is imported here: ``litert_kernels_build`` runs in the TFLite converter's own
environment, which has none of this project's dependencies.
"""
