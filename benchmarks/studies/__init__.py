"""Finished studies: each answered one question (and some set a constant of the product, named in
its docstring); kept to be run again if the question comes back. A study may import standing
benchmarks; no standing benchmark imports a study.

Nothing is imported here: ``litert_kernels_build`` runs in the TFLite converter's own
environment, which has none of this project's dependencies."""
