"""Standing benchmarks of training: the norm comparison, the fine-tune for deployment, and
Hugging Face LayerNorm models migrated to UN and converted."""
