"""Fold offline norms into the weights and export ONNX / TFLite."""
