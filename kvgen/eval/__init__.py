"""Evaluation: what the KV cache policies cost in quality (`kvgen eval-ppl`)."""
