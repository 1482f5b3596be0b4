"""Decoder models whose attention reads and writes the paged KV cache.

``SHAPES`` holds config-only folders of real models' shapes (Qwen3-0.6B, Llama-3.2-1B, their
``config.json`` as published): ``--load-format dummy --model SHAPES/qwen3-0.6b`` runs the
engine on random weights of that shape, with nothing downloaded.
"""

from pathlib import Path

SHAPES = Path(__file__).with_name("shapes")
