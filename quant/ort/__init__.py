"""The ONNX Runtime targets (cpu, tda4vm): the builder (``target``) and its search for a file
within the bars (``search``), ORT's static quantizer driven per profile (``quantize``), the graph
rewrites that make ORT's x86 kernels fast (``graph``, ``attention``, ``rewrites``), bias
correction, and TIDL's power-of-two scales (``pow2``). Imports nothing from ``quant.tflite``."""
