"""What the benchmarks share: where results go and their command line (``results``), and the
held-out comparison of two int8 files sample by sample (``paired_flips``)."""
