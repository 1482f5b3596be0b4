"""Train ``vkv-tiny``, the engine's built-in model, and write it as a Hugging Face checkpoint.

    uv run python scripts/train_vkv_tiny.py [--steps 1200] [--out vkv/models/vkv-tiny]

The model is a small Qwen3 (the architecture ``vkv/models/qwen3.py`` serves) over a byte-level
vocabulary: ids 0-255 are bytes, 256 is ``<|endoftext|>``. The corpus is the Python standard
library's own source (``*.py`` outside test folders), which every machine with Python has, so
the model is reproducible offline. Files are split by a hash of their path: about 1 in 25 is
held out, never trained on, and the held-out loss (nats per byte, and bits per byte) of the
saved fp16 weights is written with the checkpoint in ``training.json``.

Training uses ``transformers``' own Qwen3 (a dev dependency), which also shows that the
checkpoint is an ordinary one: vkv loads it with ``vkv/models/loader.py`` as it would load
Qwen3-0.6B.
"""

import argparse
import json
import math
import sysconfig
import time
import zlib
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import Qwen3Config, Qwen3ForCausalLM

EOS = 256
VOCAB_SIZE = 257
ARCHITECTURE = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rope_theta": 10_000.0,
    "tie_word_embeddings": True,
    "bos_token_id": EOS,
    "eos_token_id": EOS,
}
HELD_OUT_ONE_IN = 25


def corpus_files(stdlib: Path) -> list[Path]:
    """The standard library's non-empty Python sources, tests and installed packages left out."""
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    return sorted(
        path
        for path in stdlib.rglob("*.py")
        if not skip & set(path.relative_to(stdlib).parts[:-1]) and path.stat().st_size
    )


def is_held_out(relative: str) -> bool:
    return zlib.crc32(relative.encode()) % HELD_OUT_ONE_IN == 0


def encode_corpus(stdlib: Path) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Train and held-out token streams (each file followed by EOS) and the number of files."""
    train: list[torch.Tensor] = []
    held_out: list[torch.Tensor] = []
    end = torch.tensor([EOS])
    files = corpus_files(stdlib)
    for path in files:
        stream = held_out if is_held_out(str(path.relative_to(stdlib))) else train
        stream += [torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long(), end]
    return torch.cat(train), torch.cat(held_out), len(files)


def byte_level_tokenizer() -> Tokenizer:
    """One token per byte (GPT-2's byte-to-character map, no merges) and ``<|endoftext|>``."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    vocab = {chars[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    return tokenizer


def batches(stream: torch.Tensor, batch: int, context: int, generator: torch.Generator):
    """Endless random windows of ``context + 1`` tokens."""
    while True:
        starts = torch.randint(len(stream) - context - 1, (batch,), generator=generator)
        yield torch.stack([stream[s : s + context + 1] for s in starts.tolist()])


@torch.no_grad()
def held_out_loss(model, stream: torch.Tensor, context: int, windows: int = 96) -> float:
    """Mean next-token loss (nats per byte) over evenly spaced held-out windows."""
    model.eval()
    stride = (len(stream) - context - 1) // windows
    rows = torch.stack([stream[i * stride : i * stride + context + 1] for i in range(windows)])
    total = 0.0
    for chunk in rows.split(16):
        logits = model(input_ids=chunk[:, :-1]).logits
        total += torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum"
        ).item()
    model.train()
    return total / (windows * context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="vkv/models/vkv-tiny")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train, held_out, num_files = encode_corpus(stdlib)
    print(f"corpus: {num_files} files, {len(train):,} train bytes, {len(held_out):,} held out")
    torch.manual_seed(args.seed)
    config = Qwen3Config(**ARCHITECTURE)
    config.architectures = ["Qwen3ForCausalLM"]
    model = Qwen3ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters")
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95)
    )
    warmup = max(1, args.steps // 20)

    def learning_rate(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate)
    data = batches(train, args.batch, args.context, torch.Generator().manual_seed(args.seed))
    started = time.perf_counter()
    for step in range(args.steps):
        chunk = next(data)
        logits = model(input_ids=chunk[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if step % 50 == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - started
            print(f"step {step:5d}  loss {loss.item():.3f}  {elapsed:7.0f} s", flush=True)
    minutes = (time.perf_counter() - started) / 60

    model = model.half()
    out = Path(args.out)
    model.save_pretrained(out, safe_serialization=True)
    byte_level_tokenizer().save(str(out / "tokenizer.json"))
    loss = held_out_loss(model.float(), held_out, args.context)
    report = {
        "held_out_loss_nats_per_byte": round(loss, 4),
        "held_out_bits_per_byte": round(loss / math.log(2), 4),
        "training_minutes": round(minutes, 1),
        "threads": torch.get_num_threads(),
        "parameters": params,
        "steps": args.steps,
        "batch": args.batch,
        "context": args.context,
        "train_bytes": len(train),
        "held_out_bytes": len(held_out),
        "corpus": f"Python {sysconfig.get_python_version()} standard library, {num_files} files",
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
