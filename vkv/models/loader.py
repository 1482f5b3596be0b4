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

from vkv.config import LOAD_FORMATS, MODEL_DTYPES
from vkv.models.qwen3 import CausalLM, ModelConfig

DEFAULT_MODEL = Path(__file__).with_name("vkv-tiny")
BYTE_VOCABULARY = 257  # vkv-tiny's tokenizer: 256 bytes and an end-of-text token
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
T = TypeVar("T")


def load_checkpoint(
    path: str | Path | None,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
) -> tuple[CausalLM, Tokenizer | None, int | None]:
    """The model at ``path`` (None: ``DEFAULT_MODEL``), its tokenizer (None without
    ``tokenizer.json``) and its EOS token id.

    ``load_format="dummy"`` (vLLM's name) reads only ``config.json`` and gives the model
    random weights of its shape (``dummy_model``), to measure a model that is not on disk; a
    folder without ``tokenizer.json`` then gets vkv-tiny's byte-level tokenizer when the
    vocabulary holds its 257 ids.

    Raises ``FileNotFoundError`` for a folder without ``config.json`` or weights, and
    ``ValueError`` naming the file and what is wrong with it: a ``config.json`` that is not
    JSON or lacks a key, an architecture other than Qwen3 or Llama, a truncated or garbled
    safetensors file, a missing, unexpected or misshapen tensor, a weight that is NaN or
    infinite, an unreadable ``tokenizer.json``; and for a ``load_format`` other than
    ``LOAD_FORMATS``.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    folder = Path(path) if path is not None else DEFAULT_MODEL
    config, hf_config = _read_config(folder)
    if load_format == "dummy":
        model = dummy_model(config)
        tokenizer = _read_tokenizer(folder)
        if tokenizer is None and config.vocab_size >= BYTE_VOCABULARY:
            tokenizer = _read_tokenizer(DEFAULT_MODEL)
    else:
        model = _load_weights(folder, config)
        tokenizer = _read_tokenizer(folder)
    eos = hf_config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    return model.to(device=device, dtype=dtype).eval(), tokenizer, eos


def dummy_model(config: ModelConfig, seed: int = 0) -> CausalLM:
    """A model of ``config``'s shape with the random weights its layers are built with, drawn
    from ``seed`` (every tensor-parallel rank draws the same, then keeps its shard)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CausalLM(config)


def weights_note(path: str | Path | None, load_format: str) -> str:
    """What the start-up line says of random weights (and of weight files they stand in for)."""
    if load_format != "dummy":
        return ""
    folder = Path(path) if path is not None else DEFAULT_MODEL
    shards = len(list(folder.glob("*.safetensors")))
    ignored = f", the folder's {shards} *.safetensors ignored" if shards else ""
    return f"; random weights (--load-format dummy{ignored})"


def _load_weights(folder: Path, config: ModelConfig) -> CausalLM:
    """The model of ``config`` with the weights of ``folder``'s safetensors files, checked."""
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
    state = {key: value for key, value in state.items() if "rotary" not in key}  # HF's buffers
    expected = model.hf_state_dict()
    misshapen = [
        f"{key} {tuple(state[key].shape)} (expected {tuple(expected[key].shape)})"
        for key in expected
        if key in state and state[key].shape != expected[key].shape
    ]
    missing, unexpected = model.hf_mismatch(state)
    if missing or unexpected or misshapen:
        raise ValueError(
            f"{folder}: the weights do not match config.json (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, wrong shape {misshapen[:3]})"
        )
    model.load_hf_state_dict(state)
    return model


def _read_tokenizer(folder: Path) -> Tokenizer | None:
    """``folder``'s ``tokenizer.json``, None without one."""
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None
    return _read(
        tokenizer_file, "a tokenizers JSON file", lambda: Tokenizer.from_file(str(tokenizer_file))
    )


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


def model_dtype(device: torch.device, name: str = "auto") -> torch.dtype:
    """The dtype of the weights and of an unquantized KV cache: ``name`` (one of
    ``config.MODEL_DTYPES``; ``"auto"``: fp16 on CUDA, fp32 on a CPU). ``ValueError`` for any
    other name."""
    if name not in MODEL_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(MODEL_DTYPES)}, got {name!r}")
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return TORCH_DTYPES[name]
