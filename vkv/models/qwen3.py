"""A decoder of the Qwen3 / Llama family over a paged KV cache.

RMSNorm, rotary position embeddings, grouped-query attention with optional per-head q/k norm
(Qwen3), SwiGLU MLP, tied or untied embeddings. Parameter names are Hugging Face's, so a
checkpoint's state dict loads as it is. The model sees the batch as one flat run of tokens
(``input_ids``, ``positions``); ``AttentionMetadata`` says which sequence each token belongs to,
where its K/V go (``slot_mapping``) and which cached blocks each sequence reads. The attention
``backend`` is a module with ``store_kvcache``, ``paged_prefill_attention`` and
``paged_decode_attention``: ``vkv.kernels.reference`` (PyTorch) or
``vkv.kernels.triton_attention``.

Tensor parallelism (``vkv.engine.parallel``) splits the attention heads and the MLP's
intermediate channels over ranks: each rank keeps its rows of q/k/v and gate/up, its columns
of o/down, and an ``all_reduce`` that sums the partial outputs of o/down; ``lm_head`` keeps the
rank's slice of the vocabulary.
"""

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the tensor-parallel ranks, in place


@dataclass(slots=True, frozen=True)
class Llama3Scaling:
    """Llama 3.1's rotary scaling (``rope_type: llama3``): frequencies whose wavelength is
    longer than ``original_max_position_embeddings / low_freq_factor`` slow down ``factor``
    times, those shorter than ``... / high_freq_factor`` stay, and those between blend the
    two linearly in ``original_max_position_embeddings / wavelength``."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def apply(self, frequencies: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies."""
        context = self.original_max_position_embeddings
        in_context = context * frequencies / (2 * math.pi)  # turns over the original context
        blend = (in_context - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blend = blend.clamp(0.0, 1.0)  # 0: slowed (long waves), 1: kept (short waves)
        return frequencies / self.factor * (1 - blend) + frequencies * blend


@dataclass(slots=True, frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    qk_norm: bool = True
    attention_bias: bool = False
    rope_scaling: Llama3Scaling | None = None

    @classmethod
    def from_hf(cls, config: dict) -> "ModelConfig":
        """From a Hugging Face ``config.json`` of a Qwen3 or Llama checkpoint."""
        architectures = config.get("architectures") or []
        if not {"Qwen3ForCausalLM", "LlamaForCausalLM"} & set(architectures):
            raise ValueError(f"unsupported architecture {architectures}: Qwen3 or Llama only")
        heads = config["num_attention_heads"]
        # transformers 5 writes ``rope_parameters``; older checkpoints (Qwen3-0.6B) ``rope_theta``
        rope = config.get("rope_parameters") or {
            "rope_theta": config.get("rope_theta", 10_000.0),
            **(config.get("rope_scaling") or {}),
        }
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", 10_000.0),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            qk_norm="Qwen3ForCausalLM" in architectures,
            attention_bias=config.get("attention_bias", False),
            rope_scaling=rotary_scaling(rope),
        )


def rotary_scaling(rope: dict) -> Llama3Scaling | None:
    """The rotary scaling of a config's rope parameters: none, or Llama 3.1's; ``ValueError``
    for any other kind (or a llama3 one without its four numbers)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rotary scaling {rope}: plain RoPE or llama3 only")
    try:
        return Llama3Scaling(
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ValueError(f"the llama3 rotary scaling {rope} lacks {exc}") from None


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token's K/V go and what each sequence reads, for one step."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens]
    block_tables: torch.Tensor  # [num_seqs, max_blocks], -1 padded
    context_lens: torch.Tensor  # [num_seqs], cached tokens after this step's writes
    cu_seqlens_q: torch.Tensor | None = None  # [num_seqs + 1], prefill only


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x / sqrt(mean(x^2) + eps)`` in fp32, back to ``x``'s dtype, times the weight."""
        normed = nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


@functools.cache
def inverse_frequencies(
    head_dim: int, theta: float, device: torch.device, scaling: Llama3Scaling | None = None
) -> torch.Tensor:
    """``theta ** (-2i / head_dim)`` for each rotating pair ``i``, in fp32, then ``scaling``'s
    (the same every step: computed once per model shape and device)."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
    frequencies = 1.0 / theta ** (exponents / head_dim)
    return frequencies if scaling is None else scaling.apply(frequencies)


def rotary_angles(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: Llama3Scaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine of each position's rotary angles, ``[tokens, 1, head_dim]`` each (the
    half-split convention: dimension ``i`` and ``i + head_dim / 2`` rotate together)."""
    frequencies = inverse_frequencies(head_dim, theta, positions.device, scaling)
    angles = positions.float()[:, None] * frequencies[None, :]
    angles = torch.cat([angles, angles], -1)[:, None, :]
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[tokens, heads, head_dim]``."""
    half = x.shape[-1] // 2
    x32 = x.float()
    turned = torch.cat([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos + turned * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.num_heads, self.num_kv_heads = c.num_heads, c.num_kv_heads  # this rank's (see TP)
        self.all_reduce: AllReduce | None = None  # sums o_proj over ranks
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(
        self,
        rotary: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: ModuleType,
    ) -> torch.Tensor:
        c = self.config
        tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(tokens, self.num_heads, c.head_dim)
        k = self.k_proj(hidden).view(tokens, self.num_kv_heads, c.head_dim)
        v = self.v_proj(hidden).view(tokens, self.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, *rotary), rotate(k, *rotary)
        k_cache, v_cache = cache
        backend.store_kvcache(k.contiguous(), v.contiguous(), k_cache, v_cache, meta.slot_mapping)
        scale = c.head_dim**-0.5
        if meta.is_prefill:
            out = backend.paged_prefill_attention(
                q.contiguous(),
                k_cache,
                v_cache,
                meta.cu_seqlens_q,
                meta.block_tables,
                meta.context_lens,
                scale,
            )
        else:
            out = backend.paged_decode_attention(
                q.contiguous(), k_cache, v_cache, meta.block_tables, meta.context_lens, scale
            )
        out = self.o_proj(out.reshape(tokens, self.num_heads * c.head_dim))
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.all_reduce: AllReduce | None = None  # sums down_proj over ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))``, the activation written over the gate's output (a
        prefill's are megabytes: no new tensor to allocate and fill)."""
        gate = self.gate_proj(x)
        nn.functional.silu(gate, inplace=True)
        out = self.down_proj(gate.mul_(self.up_proj(x)))
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, rotary, hidden, cache, meta, backend) -> torch.Tensor:
        hidden = hidden + self.self_attn(rotary, self.input_layernorm(hidden), cache, meta, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder and its head: ``forward`` returns the logits of every token it is given."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: ModuleType,
    ) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        c = self.config
        rotary = rotary_angles(positions, c.head_dim, c.rope_theta, c.rope_scaling)
        for layer, cache in zip(self.model.layers, caches, strict=True):
            hidden = layer(rotary, hidden, cache, meta, backend)
        return self.lm_head(self.model.norm(hidden))
