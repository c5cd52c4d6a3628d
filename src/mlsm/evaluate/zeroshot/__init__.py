"""Scores without fine-tuning: PLL, minimal pairs (BLiMP), held-out masked tokens, the unigram
control, effective rank and frozen-encoder linear probes. Imports only the wings below."""
