"""The measurements behind the documentation's numbers: each module is one benchmark, run from
the repository's root as a module (``.venv/bin/python -m benchmarks.GROUP.NAME --help`` for its
options), writing ``benchmarks/results/NAME.*``. Standing benchmarks by what they measure
(``conversion``, ``speed``, ``service``, ``training``), finished ``studies`` apart, shared code in
``common`` (index: ``benchmarks/README.md``). They use the product (edge_un, converters, quant,
service) from outside, through its public API, as a user would.

Nothing is imported here: ``studies.litert_kernels_build`` runs in the TFLite converter's own
environment, which has none of this project's dependencies.
"""
