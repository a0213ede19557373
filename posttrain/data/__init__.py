"""Data: tokenizers, JSONL sources (local, gs://), grain pipelines, packing, synthetic tasks."""
