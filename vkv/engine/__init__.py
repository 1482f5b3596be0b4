"""The engine: the graded KV-memory modules (solution regions) and the provided engine loop."""
