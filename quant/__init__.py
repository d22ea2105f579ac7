"""int8 post-training quantization per edge target, and its measurements."""
