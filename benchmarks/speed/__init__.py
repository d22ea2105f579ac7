"""Standing benchmarks of speed and size: latency of the files each target ships, the cpu
recipe's speed against LiteRT's, and conversions at BERT-base and ViT-B/16 size."""
