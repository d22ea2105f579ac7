"""Standing benchmarks of conversion: does a model convert, and what did int8 cost, on every
target (the bundled examples, every source form, the attention forms, the Hugging Face families,
the two TFLite routes)."""
