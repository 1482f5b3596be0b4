"""Load a Hugging Face checkpoint folder from disk: ``config.json``, ``*.safetensors`` and, if
present, ``tokenizer.json`` (through the ``tokenizers`` library). Nothing is downloaded.

``DEFAULT_MODEL`` is ``vkv-tiny``, the checkpoint shipped inside the package (a 3.2M-parameter
byte-level Qwen3 trained on the Python standard library by ``scripts/train_vkv_tiny.py``).
"""

import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from vkv.models.qwen3 import CausalLM, ModelConfig

DEFAULT_MODEL = Path(__file__).with_name("vkv-tiny")
T = TypeVar("T")


def load_checkpoint(
    path: str | Path | None, dtype: torch.dtype, device: torch.device
) -> tuple[CausalLM, Tokenizer | None, int | None]:
    """The model at ``path`` (None: ``DEFAULT_MODEL``), its tokenizer (None without
    ``tokenizer.json``) and its EOS token id.

    Raises ``FileNotFoundError`` for a folder without ``config.json`` or weights, and
    ``ValueError`` naming the file and what is wrong with it: a ``config.json`` that is not
    JSON or lacks a key, an architecture other than Qwen3 or Llama, a truncated or garbled
    safetensors file, a missing, unexpected or misshapen tensor, a weight that is NaN or
    infinite, an unreadable ``tokenizer.json``.
    """
    folder = Path(path) if path is not None else DEFAULT_MODEL
    config, hf_config = _read_config(folder)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{folder} holds no *.safetensors weights")
    model = CausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights = _read(shard, "a safetensors file", lambda shard=shard: load_file(shard))
        for name, tensor in weights.items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise ValueError(f"{shard}: tensor {name} holds NaN or infinite values")
        state.update(weights)
    if config.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    expected = model.state_dict()
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected and "rotary" not in key]
    misshapen = [
        f"{key} {tuple(state[key].shape)} (expected {tuple(expected[key].shape)})"
        for key in expected
        if key in state and state[key].shape != expected[key].shape
    ]
    if missing or unexpected or misshapen:
        raise ValueError(
            f"{folder}: the weights do not match config.json (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, wrong shape {misshapen[:3]})"
        )
    model.load_state_dict(state, strict=False)
    tokenizer_file = folder / "tokenizer.json"
    tokenizer = None
    if tokenizer_file.is_file():
        tokenizer = _read(
            tokenizer_file,
            "a tokenizers JSON file",
            lambda: Tokenizer.from_file(str(tokenizer_file)),
        )
    eos = hf_config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    return model.to(device=device, dtype=dtype).eval(), tokenizer, eos


def read_config(path: str | Path | None) -> ModelConfig:
    """The model configuration of the checkpoint at ``path`` (None: ``DEFAULT_MODEL``), with
    the errors of ``load_checkpoint``, without loading its weights."""
    return _read_config(Path(path) if path is not None else DEFAULT_MODEL)[0]


def _read_config(folder: Path) -> tuple[ModelConfig, dict]:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} is not a checkpoint folder: config.json is missing")
    hf_config = _read(config_file, "JSON", lambda: json.loads(config_file.read_text()))
    if not isinstance(hf_config, dict):
        raise ValueError(
            f"{config_file} is not a JSON object: it holds a {type(hf_config).__name__}"
        )
    try:
        return ModelConfig.from_hf(hf_config), hf_config
    except KeyError as exc:
        raise ValueError(f"{config_file} lacks the key {exc}") from None


def _read(file: Path, what: str, read: Callable[[], T]) -> T:
    """``read()``, or a ``ValueError`` naming ``file`` when it is not ``what`` it should be."""
    try:
        return read()
    except Exception as exc:  # each library raises its own kind; all mean a bad file
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{file} is not {what}: {first_line[:200]}") from None


def model_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the weights and of an unquantized KV cache: fp16 on CUDA, fp32 on a CPU."""
    return torch.float16 if device.type == "cuda" else torch.float32
