"""The paged decoder against Hugging Face transformers on the same random checkpoint.

Prefill two prompts through the paged cache (shuffled blocks), then decode greedily; at every
step the logits must equal those of transformers' own Qwen3 / Llama recomputing the whole
sequence without a cache. Both attention backends, each where it runs (``devices.py``): PyTorch
on each device, Triton on ``KERNEL_DEVICE`` (interpreted on a CPU); float32, as transformers.
"""

import pytest
import torch
from devices import BACKENDS
from tiny_checkpoints import paired

from vkv.kernels import reference, triton_attention
from vkv.models.qwen3 import AttentionMetadata, ModelConfig

BLOCK_SIZE = 4
KERNELS = {"torch": reference, "triton": triton_attention}


def metadata(seqs, tables, prefill, device):
    """Metadata for one step on ``device``: prefill computes every token, decode the last of
    each."""
    slots, positions, tokens, cu = [], [], [], [0]
    for seq, table in zip(seqs, tables, strict=True):
        run = range(len(seq)) if prefill else range(len(seq) - 1, len(seq))
        for pos in run:
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            positions.append(pos)
            tokens.append(seq[pos])
        cu.append(len(tokens))
    width = max(len(t) for t in tables)
    padded = [t + [-1] * (width - len(t)) for t in tables]
    meta = AttentionMetadata(
        is_prefill=prefill,
        slot_mapping=torch.tensor(slots, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        context_lens=torch.tensor([len(s) for s in seqs], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
    )
    return torch.tensor(tokens, device=device), torch.tensor(positions, device=device), meta


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_paged_generation_matches_transformers(name, backend, device):
    hf, ours = paired(name)
    ours.to(device)
    seqs = [[5, 17, 3, 88, 41, 9, 60], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    free = list(torch.randperm(16).tolist())
    tables = [[free.pop() for _ in range(6)] for _ in seqs]  # room for 24 tokens each
    caches = [torch.zeros(2, 16, BLOCK_SIZE, 2, 16, device=device).unbind(0) for _ in range(2)]
    with torch.no_grad():
        for step in range(4):
            tokens, positions, meta = metadata(seqs, tables, step == 0, device)
            logits = ours(tokens, positions, caches, meta, KERNELS[backend])
            last = logits[meta.cu_seqlens_q[1:] - 1] if step == 0 else logits
            for i, seq in enumerate(seqs):
                expected = hf(torch.tensor([seq])).logits[0, -1]
                torch.testing.assert_close(last[i].cpu(), expected, atol=1e-4, rtol=1e-4)
                seq.append(int(expected.argmax()))


def test_unsupported_architecture_is_rejected():
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})


def test_rope_theta_is_read_from_either_config_format():
    hf, _ = paired("qwen3")
    new_style = hf.config.to_dict()
    legacy = {key: value for key, value in new_style.items() if key != "rope_parameters"}
    legacy["rope_theta"] = 1_000_000.0  # how Qwen3-0.6B's config.json (transformers 4) says it
    assert ModelConfig.from_hf(new_style).rope_theta == 500_000.0
    assert ModelConfig.from_hf(legacy).rope_theta == 1_000_000.0
    scaled = new_style | {"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3"}}
    with pytest.raises(ValueError, match="rotary scaling"):
        ModelConfig.from_hf(scaled)
