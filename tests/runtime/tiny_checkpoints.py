"""Tiny random checkpoints of transformers' Qwen3 and Llama, and their greedy output computed
without any cache: the independent references of the runtime tests."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from vkv.models.qwen3 import CausalLM, ModelConfig

SIZES = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    # transformers' default (0.02) makes a model that repeats the prompt's last token whatever
    # came before it, so that a broken cache or attention would still give its greedy tokens;
    # at 0.2 the tokens depend on the context
    "initializer_range": 0.2,
}
ARCHITECTURES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"tie_word_embeddings": True, "rope_theta": 5e5}),
    "llama": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": False}),
}


def tiny_hf_model(architecture: str = "qwen3", **overrides):
    """A seeded random transformers model of the given architecture, in eval mode."""
    config_class, model_class, defaults = ARCHITECTURES[architecture]
    config = config_class(**(SIZES | defaults | overrides))
    config.architectures = [model_class.__name__]
    torch.manual_seed(0)
    return model_class(config).eval()


def paired(architecture: str = "qwen3"):
    """The transformers model and ours holding the same weights."""
    hf = tiny_hf_model(architecture)
    ours = CausalLM(ModelConfig.from_hf(hf.config.to_dict())).eval()
    missing, unexpected = ours.load_hf_state_dict(hf.state_dict())
    assert not missing and all("rotary" in key for key in unexpected), (missing, unexpected)
    return hf, ours


def greedy_by_recompute(hf, prompt: list[int], count: int, eos: int | None = None) -> list[int]:
    """``count`` greedy tokens (fewer at ``eos``), recomputing the whole sequence each time."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
            if seq[-1] == eos:
                break
    return seq[len(prompt) :]
