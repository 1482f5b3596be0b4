"""A decoder of the Qwen3 / Llama family over a paged KV cache.

RMSNorm, rotary position embeddings, grouped-query attention with optional per-head q/k norm
(Qwen3), SwiGLU MLP, tied or untied embeddings. Parameter names are Hugging Face's, so a
checkpoint's state dict loads as it is. The model sees the batch as one flat run of tokens
(``input_ids``, ``positions``); ``AttentionMetadata`` says which sequence each token belongs to,
where its K/V go (``slot_mapping``) and which cached blocks each sequence reads. The attention
``backend`` is a module with ``store_kvcache``, ``paged_prefill_attention`` and
``paged_decode_attention``: ``vkv.kernels.reference`` (PyTorch) or
``vkv.kernels.triton_attention``.

Fewer, larger operations per layer (what a decode step's time is made of once the batch is
small: one launch or one call per op): q, k and v are one projection (``qkv_proj``), gate and
up another (``gate_up_proj``), as in vLLM and nano-vLLM; ``MergedLinear`` says which rows
belong to which, so that a checkpoint's separate tensors load into it
(``CausalLM.load_hf_state_dict``) and come back out under their own names
(``hf_state_dict``). The small operations are ``vkv.kernels.layer_ops``'s, one call each: a
norm adds its input to the residual stream and normalizes the sum (vLLM's residual
convention: a layer returns its output and the stream, and the next norm adds them), q and k
are normalized and turned by the rotary table in place, and the MLP's activation multiplies
the gate by the up projection. The rotary cosines and sines are a table by position, built
once in the model's dtype.

Tensor parallelism (``vkv.engine.parallel``) splits the attention heads and the MLP's
intermediate channels over ranks: each rank keeps its rows of each part of qkv and gate/up,
its columns of o/down, and an ``all_reduce`` that sums the partial outputs of o/down;
``lm_head`` keeps the rank's slice of the vocabulary.
"""

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from vkv.kernels import layer_ops

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
    max_context_len: int | None = None  # max(context_lens), known on the host (None: read it)
    max_query_len: int | None = None  # the most new tokens of a sequence, prefill, on the host


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream plus ``x`` (updated in place; ``x`` when there is no stream
        yet), normalized: ``stream / sqrt(mean(stream^2) + eps)`` in fp32, back to its dtype,
        times the weight; returns ``(normalized, stream)`` (``layer_ops.add_rms_norm``)."""
        return layer_ops.add_rms_norm(x, residual, self.weight, self.eps)


class MergedLinear(nn.Linear):
    """Several linears of one input stacked into one (vLLM's ``QKVParallelLinear`` and
    ``MergedColumnParallelLinear``): one matrix multiply instead of ``len(parts)``. ``parts``
    are the output rows of each, in order, as ``split`` takes them; ``names`` the checkpoint's
    names for them."""

    def __init__(self, in_features: int, parts: Sequence[int], names: Sequence[str], bias: bool):
        super().__init__(in_features, sum(parts), bias=bias)
        self.parts, self.names = tuple(parts), tuple(names)


@functools.cache
def inverse_frequencies(
    head_dim: int, theta: float, device: torch.device, scaling: Llama3Scaling | None = None
) -> torch.Tensor:
    """``theta ** (-2i / head_dim)`` for each rotating pair ``i``, in fp32, then ``scaling``'s
    (the same every step: computed once per model shape and device)."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
    frequencies = 1.0 / theta ** (exponents / head_dim)
    return frequencies if scaling is None else scaling.apply(frequencies)


class RotaryTable:
    """The rotary cosines and sines of positions ``0 .. len - 1``, computed in fp32 and kept in
    the model's dtype (what Hugging Face's rotary embedding hands its layers), grown by doubling
    when a step reaches past them.

    The half-split convention: dimension ``i`` and ``i + head_dim / 2`` rotate together, so
    ``rotate_half(x) = cat(-x[half:], x[:half])``; the table keeps the sine with the first
    half negated, so that a layer turns ``x`` with ``x.roll(half)`` and no negation.

    The table grows to the step's longest context, a number the model runner knows on the host
    (``AttentionMetadata.max_context_len``): reading the largest position from a GPU tensor
    would stall the step until the GPU caught up."""

    def __init__(self, head_dim: int, theta: float, scaling: Llama3Scaling | None) -> None:
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.cos = self.signed_sin = torch.empty(0, head_dim)

    def reserve(self, length: int, device: torch.device, dtype: torch.dtype) -> None:
        """Rows for positions ``0 .. length - 1`` on ``device`` in ``dtype``."""
        if self.cos.device != device or self.cos.dtype != dtype:
            self.cos = self.signed_sin = torch.empty(0, self.head_dim, device=device, dtype=dtype)
        if length > len(self.cos):
            self._build(max(length, 2 * len(self.cos), 256), device, dtype)

    def lookup(self, positions: torch.Tensor, length: int | None, dtype: torch.dtype) -> "Rotary":
        """The table for ``positions``, reserved past them; ``length`` bounds them (None: read
        from ``positions``)."""
        if length is None:
            length = int(positions.max()) + 1 if len(positions) else 0
        self.reserve(length, positions.device, dtype)
        return Rotary(positions, self.cos, self.signed_sin)

    def _build(self, length: int, device: torch.device, dtype: torch.dtype) -> None:
        frequencies = inverse_frequencies(self.head_dim, self.theta, device, self.scaling)
        angles = torch.arange(length, device=device).float()[:, None] * frequencies[None, :]
        sin = angles.sin()
        self.cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
        self.signed_sin = torch.cat([-sin, sin], -1).to(dtype)


@dataclass(slots=True, frozen=True)
class Rotary:
    """One step's tokens' positions and the table that covers them (``RotaryTable.lookup``)."""

    positions: torch.Tensor
    cos: torch.Tensor
    signed_sin: torch.Tensor

    def turn(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        norms: tuple["RMSNorm", "RMSNorm"] | None,
    ) -> None:
        """In place, each head of ``q`` and ``k`` ``[tokens, heads, head_dim]`` normalized by
        ``norms`` (Qwen3's q/k norm; None: Llama), then turned by its token's position:
        ``x * cos + rotate_half(x) * sin`` (``layer_ops.qk_norm_rotary``)."""
        q_weight, k_weight, eps = (
            (None, None, 0.0) if norms is None else (norms[0].weight, norms[1].weight, norms[0].eps)
        )
        layer_ops.qk_norm_rotary(
            q, k, self.positions, self.cos, self.signed_sin, q_weight, k_weight, eps
        )


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        names = ("q_proj", "k_proj", "v_proj")
        self.qkv_proj = MergedLinear(
            c.hidden_size, (q_rows, kv_rows, kv_rows), names, bias=c.attention_bias
        )
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.num_heads, self.num_kv_heads = c.num_heads, c.num_kv_heads  # this rank's (see TP)
        self.all_reduce: AllReduce | None = None  # sums o_proj over ranks
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(
        self,
        rotary: "Rotary",
        hidden: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: ModuleType,
    ) -> torch.Tensor:
        c = self.config
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.parts, -1)  # views of one tensor
        q = q.view(tokens, self.num_heads, c.head_dim)
        k = k.view(tokens, self.num_kv_heads, c.head_dim)
        v = v.view(tokens, self.num_kv_heads, c.head_dim)
        rotary.turn(q, k, (self.q_norm, self.k_norm) if c.qk_norm else None)
        k_cache, v_cache = cache
        backend.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        scale = c.head_dim**-0.5
        if meta.is_prefill:
            out = backend.paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                meta.cu_seqlens_q,
                meta.block_tables,
                meta.context_lens,
                scale,
                meta.max_query_len,
            )
        else:
            out = backend.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale
            )
        out = self.o_proj(out.reshape(tokens, self.num_heads * c.head_dim))
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        rows = config.intermediate_size
        self.gate_up_proj = MergedLinear(
            config.hidden_size, (rows, rows), ("gate_proj", "up_proj"), bias=False
        )
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.all_reduce: AllReduce | None = None  # sums down_proj over ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))``, gate and up from one projection, the activation
        and product in one call (``layer_ops.silu_and_mul``)."""
        out = self.down_proj(layer_ops.silu_and_mul(self.gate_up_proj(x)))
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

    def forward(
        self, rotary, hidden, residual, cache, meta, backend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output and the residual stream before it (the next norm adds them)."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rotary, hidden, cache, meta, backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


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
        self.rotary = RotaryTable(config.head_dim, config.rope_theta, config.rope_scaling)

    def merged_linears(self) -> dict[str, MergedLinear]:
        """Each ``MergedLinear`` by its name (``model.layers.0.mlp.gate_up_proj``)."""
        return {n: m for n, m in self.named_modules() if isinstance(m, MergedLinear)}

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The state dict under a Hugging Face checkpoint's names: each merged linear's rows
        split back into the linears it stacks (views, no copy)."""
        state = self.state_dict()
        for name, linear in self.merged_linears().items():
            prefix = name.rsplit(".", 1)[0]
            for kind in ("weight", "bias"):
                merged = state.pop(f"{name}.{kind}", None)
                if merged is None:
                    continue
                for part, rows in zip(linear.names, merged.split(linear.parts), strict=True):
                    state[f"{prefix}.{part}.{kind}"] = rows
        return state

    def hf_mismatch(self, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """The names of a checkpoint's tensors that ``state`` lacks, and those it has beyond
        them (checkpoint naming)."""
        expected = self.hf_state_dict().keys()
        missing = [key for key in expected if key not in state]
        return missing, [key for key in state if key not in expected]

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """Load a checkpoint's tensors, stacking the linears each ``MergedLinear`` merges (the
        tensors of the right shapes: ``load_state_dict`` raises otherwise); ``hf_mismatch``'s
        names."""
        missing, unexpected = self.hf_mismatch(state)
        ignored = set(unexpected)
        merged = {key: value for key, value in state.items() if key not in ignored}
        for name, linear in self.merged_linears().items():
            prefix = name.rsplit(".", 1)[0]
            for kind in ("weight", "bias"):
                keys = [f"{prefix}.{part}.{kind}" for part in linear.names]
                if all(key in merged for key in keys):
                    merged[f"{name}.{kind}"] = torch.cat([merged.pop(key) for key in keys])
        self.load_state_dict(merged, strict=False)
        return missing, unexpected

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: ModuleType,
    ) -> torch.Tensor:
        hidden, residual = self.model.embed_tokens(input_ids), None
        rotary = self.rotary.lookup(positions, meta.max_context_len, hidden.dtype)
        for layer, cache in zip(self.model.layers, caches, strict=True):
            hidden, residual = layer(rotary, hidden, residual, cache, meta, backend)
        return self.lm_head(self.model.norm(hidden, residual)[0])
