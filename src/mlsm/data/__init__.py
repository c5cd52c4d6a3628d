"""Corpus preparation, batches and masking."""
