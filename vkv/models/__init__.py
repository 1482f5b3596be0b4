"""Decoder models whose attention reads and writes the paged KV cache."""
