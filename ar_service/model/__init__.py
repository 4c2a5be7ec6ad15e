"""Torch side of the AR stage: configuration, modeling, tokenizer, loading and the tiny test model."""
