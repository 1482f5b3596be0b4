"""Load a Hugging Face checkpoint folder from disk: ``config.json``, ``*.safetensors`` and, if
present, ``tokenizer.json`` (through the ``tokenizers`` library). Nothing is downloaded.

``DEFAULT_MODEL`` is ``vkv-tiny``, the checkpoint shipped inside the package (a 3.2M-parameter
byte-level Qwen3 trained on the Python standard library by ``scripts/train_vkv_tiny.py``).
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from vkv.models.qwen3 import CausalLM, ModelConfig

DEFAULT_MODEL = Path(__file__).with_name("vkv-tiny")


def load_checkpoint(
    path: str | Path | None, dtype: torch.dtype, device: torch.device
) -> tuple[CausalLM, Tokenizer | None, int | None]:
    """The model at ``path`` (None: ``DEFAULT_MODEL``), its tokenizer (None without
    ``tokenizer.json``) and its EOS token id.

    Raises ``FileNotFoundError`` for a folder without ``config.json`` or weights, and
    ``ValueError`` for an architecture other than Qwen3 or Llama.
    """
    folder = Path(path) if path is not None else DEFAULT_MODEL
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a checkpoint folder: config.json is missing")
    hf_config = json.loads((folder / "config.json").read_text())
    config = ModelConfig.from_hf(hf_config)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{folder} holds no *.safetensors weights")
    model = CausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(shard))
    if config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    unexpected = [key for key in unexpected if "rotary" not in key]
    if missing or unexpected:
        raise ValueError(
            f"{folder}: weights do not match the model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    tokenizer_file = folder / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_file)) if tokenizer_file.is_file() else None
    eos = hf_config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    return model.to(device=device, dtype=dtype).eval(), tokenizer, eos
