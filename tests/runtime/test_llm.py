"""LLM / LLMEngine on a checkpoint folder on disk (config.json, safetensors, tokenizer.json).

What is compared with transformers' tokens runs in float32 (``devices.py``)."""

import json
import random
import shutil

import pytest
from devices import EXACT_DTYPE
from safetensors.torch import load_file, save_file
from tiny_checkpoints import greedy_by_recompute, tiny_hf_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from vkv import LLM, SamplingParams
from vkv.cli import main
from vkv.engine.llm_engine import LLMEngine

TEXT = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"] * 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoint")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(TEXT, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    hf = tiny_hf_model(
        vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=256, eos_token_id=0
    )
    hf.save_pretrained(folder, safe_serialization=True)
    return folder, hf, tokenizer


def greedy(hf, ids, count):
    return greedy_by_recompute(hf, ids, count, eos=0)


def test_generate_matches_transformers_and_decodes_text(checkpoint, device):
    folder, hf, tokenizer = checkpoint
    llm = LLM(folder, block_size=4, kv_cache_bytes=1 << 20, device=device, dtype=EXACT_DTYPE)
    prompts = ["def fibonacci(n):", "return n"]
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=6), use_progress=False
    )
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = greedy(hf, tokenizer.encode(prompt).ids, 6)
        assert output["token_ids"] == expected
        assert output["text"] == tokenizer.decode(expected)


def test_streaming_outputs_add_up_to_the_text(checkpoint):
    folder, _, _ = checkpoint
    engine = LLMEngine(folder, block_size=4, kv_cache_bytes=1 << 20)
    request = engine.add_request(
        "def", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    )
    pieces, finished = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            pieces.append(output.new_text)
            finished = output
    assert finished.request_id == request and finished.finish_reason == "length"
    assert "".join(pieces) == engine.decode(finished.token_ids)
    assert set(engine.stats) >= {"running", "waiting", "swapped", "gpu_kv_usage", "preemptions"}


def test_a_finished_request_is_kept_until_forgotten_and_generate_forgets_its_own(checkpoint):
    folder, _, _ = checkpoint
    llm = LLM(folder, block_size=4, kv_cache_bytes=1 << 20)
    engine = llm.engine
    params = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, n=2, seed=1)
    running = engine.add_request("def", SamplingParams(max_tokens=50, ignore_eos=True))
    done = engine.add_request("return", params)
    while not all(s.is_finished for s in engine.samples(done)):
        engine.step()
    assert engine.num_held_requests == 2
    assert engine.sequence(done).num_completion_tokens == 4, "finished, and still answered for"
    with pytest.raises(ValueError, match="unfinished"):
        engine.forget(running)
    engine.forget(done)
    assert engine.num_held_requests == 1
    with pytest.raises(KeyError):
        engine.sequence(done)
    with pytest.raises(ValueError, match="no request"):
        engine.forget(done)
    engine.abort(running)
    engine.forget(running)
    assert engine.num_held_requests == 0
    outputs = llm.generate(["def", "return"], params, use_progress=False)
    assert [len(o["outputs"]) for o in outputs] == [2, 2]
    assert engine.num_held_requests == 0, "generate forgets the requests it answered"
    kept = engine.outputs
    assert not (engine._requests or kept.streamed or kept.logprobs or kept.sample_of)


def test_bad_input_is_rejected_and_leaves_other_requests_alone(checkpoint):
    folder, _, _ = checkpoint
    engine = LLMEngine(folder, block_size=4, kv_cache_bytes=1 << 20, max_model_len=32)
    good = engine.add_request("def", SamplingParams(temperature=0.0, max_tokens=3))
    free = engine.scheduler.block_manager.num_free_gpu_blocks
    for prompt in ("", [], [1] * 33, [10**6]):
        with pytest.raises(ValueError):
            engine.add_request(prompt)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=1.5)
    assert engine.scheduler.block_manager.num_free_gpu_blocks == free
    assert engine.scheduler.num_unfinished == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine._requests[good].num_completion_tokens >= 1


def test_unknown_path_and_unsupported_architecture(tmp_path):
    with pytest.raises(FileNotFoundError):
        LLMEngine(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLMEngine(tmp_path)


def test_vkv_generate_command(checkpoint, capsys):
    folder, hf, tokenizer = checkpoint
    code = main(
        [
            "generate",
            "def f",
            "--model",
            str(folder),
            "--max-tokens",
            "4",
            "--block-size",
            "4",
            "--temperature",
            "0",
            "--dtype",
            EXACT_DTYPE,
        ]
    )
    assert code == 0
    expected = tokenizer.decode(greedy(hf, tokenizer.encode("def f").ids, 4))
    assert expected in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_request_that_outgrows_the_pool_ends_ignored_in_both_preemption_modes(checkpoint, mode):
    """The swap-mode livelock of the review: 8 blocks of 1 token, a 5-token prompt, 20 tokens."""
    folder, _, _ = checkpoint
    engine = LLMEngine(
        folder,
        block_size=1,
        num_gpu_blocks=8,
        num_cpu_blocks=16,
        max_model_len=64,
        preemption_mode=mode,
    )
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    request = engine.add_request([5, 6, 7, 8, 9], params)
    steps, finished = 0, []
    while engine.has_unfinished_requests() and steps < 100:
        finished += [out for out in engine.step() if out.finished]
        steps += 1
    assert not engine.has_unfinished_requests(), f"{mode}: not finished after 100 steps"
    assert [(out.request_id, out.finish_reason) for out in finished] == [(request, "ignored")], (
        "8 blocks hold 8 tokens: the sequence can never take its ninth, so it is ignored"
    )
    assert len(finished[0].token_ids) == 4, (
        "it keeps what it generated: 8 tokens fill the pool, and the ninth (sampled from the "
        "eighth) has no slot for its K/V"
    )
    manager = engine.scheduler.block_manager
    assert manager.num_free_gpu_blocks == 8 and manager.num_free_cpu_blocks == 16


def test_generate_returns_when_a_request_outgrows_the_pool(checkpoint):
    folder, _, _ = checkpoint
    llm = LLM(folder, block_size=1, num_gpu_blocks=8, num_cpu_blocks=16, preemption_mode="swap")
    short, long = llm.generate(
        ["def", "return n"],
        [
            SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        ],
        use_progress=False,
    )
    assert short["finish_reason"] == "length" and long["finish_reason"] == "ignored"


def corrupted_copy(folder, tmp_path, name, damage):
    """A copy of the checkpoint ``folder`` with ``damage(path)`` applied to its file ``name``."""
    copy = tmp_path / "broken"
    shutil.copytree(folder, copy)
    damage(copy / name)
    return copy


def truncate(path):
    path.write_bytes(path.read_bytes()[:100])


def garble(path):
    path.write_bytes(b"\x00\xff garbage " * 20)


def drop_key(path):
    config = json.loads(path.read_text())
    del config["num_attention_heads"]
    path.write_text(json.dumps(config))


def scramble(path):
    """Seeded random bytes over every tensor's data; the safetensors header stays intact."""
    data = path.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    path.write_bytes(data[:start] + random.Random(0).randbytes(len(data) - start))


def poison(path):
    weights = load_file(path)
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, path)


def reshape(path):
    weights = load_file(path)
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1].clone()
    save_file(weights, path)


@pytest.mark.parametrize(
    ("name", "damage", "said"),
    [
        ("model.safetensors", truncate, "model.safetensors is not a safetensors file"),
        ("model.safetensors", garble, "model.safetensors is not a safetensors file"),
        ("model.safetensors", scramble, "holds NaN or infinite values"),
        ("model.safetensors", poison, "tensor model.norm.weight holds NaN or infinite values"),
        ("model.safetensors", reshape, "wrong shape ['model.norm.weight"),
        ("config.json", drop_key, "config.json lacks the key 'num_attention_heads'"),
        ("config.json", garble, "config.json is not JSON"),
        ("tokenizer.json", garble, "tokenizer.json is not a tokenizers JSON file"),
    ],
    ids=[
        "truncated",
        "garbled",
        "random bytes",
        "nan",
        "misshapen",
        "missing key",
        "bad json",
        "bad tokenizer",
    ],
)
def test_a_damaged_checkpoint_is_one_clear_error_naming_the_file(
    checkpoint, tmp_path, name, damage, said, capsys
):
    folder, _, _ = checkpoint
    broken = corrupted_copy(folder, tmp_path, name, damage)
    with pytest.raises(ValueError) as raised:
        LLMEngine(broken, block_size=4, kv_cache_bytes=1 << 20)
    assert said in str(raised.value), str(raised.value)
    assert main(["generate", "def", "--model", str(broken), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert said in " ".join(err.split()) and "Traceback" not in err, err


def byte_fallback_tokenizer():
    """A Llama-style tokenizer: SentencePiece spaces (▁), and bytes for what the vocabulary
    lacks (``<0xE2>`` ...), so that one character can take several tokens."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for word in ("▁", "▁def", "▁f", "(x", "):", "▁return", "x", "▁+", "1"):
        vocab[word] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tokenizer, vocab


@pytest.mark.parametrize("seed", range(20))
def test_incremental_detokenizing_adds_up_to_the_text_with_byte_fallback(seed):
    from vkv.engine.outputs import Detokenized, Detokenizer

    tokenizer, vocab = byte_fallback_tokenizer()
    words = [i for name, i in vocab.items() if not name.startswith("<")]
    euro = [vocab["<0xE2>"], vocab["<0x82>"], vocab["<0xAC>"]]  # "€", three byte tokens
    rng = random.Random(seed)
    tokens = []
    for _ in range(12):
        tokens += euro if rng.random() < 0.3 else [rng.choice(words)]
    detokenizer = Detokenizer(tokenizer)
    state, pieces = Detokenized(), []
    for end in range(1, len(tokens) + 1):
        piece = detokenizer.new_text(state, tokens[:end], end == len(tokens))
        assert "\ufffd" not in piece, f"half a character streamed: {piece!r}"
        pieces.append(piece)
    assert "".join(pieces) == tokenizer.decode(tokens)
