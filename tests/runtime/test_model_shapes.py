"""Real models' shapes without their weights: ``--load-format dummy``, the config-only folders
the package ships (``vkv.models.SHAPES``), and Llama 3.1's rotary scaling that Llama-3.2-1B's
shape needs (against transformers' own Llama)."""

import json
import shutil

import pytest
import torch
from tiny_checkpoints import SIZES, tiny_hf_model

from vkv.cli import _parser, main
from vkv.engine.llm_engine import LLMEngine
from vkv.kernels import reference
from vkv.models import SHAPES
from vkv.models.loader import DEFAULT_MODEL, load_checkpoint, read_config
from vkv.models.qwen3 import AttentionMetadata, CausalLM, ModelConfig
from vkv.sampling_params import SamplingParams

# The parameter counts their model cards give (Qwen3-0.6B: 0.44B without the embedding).
PUBLISHED = {"qwen3-0.6b": 596_049_920, "llama-3.2-1b": 1_235_814_400}
TINY = SIZES | {"architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True}
CPU = torch.device("cpu")


def config_folder(tmp_path, config: dict):
    """A checkpoint folder that holds only ``config.json``."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_shipped_shapes_have_their_models_parameter_counts(name):
    config = read_config(SHAPES / name)
    with torch.device("meta"):  # the shape only: no memory, no time
        model = CausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
    assert sorted(path.name for path in (SHAPES / name).iterdir()) == ["config.json"]


def test_dummy_weights_are_random_of_the_shape_and_the_same_on_every_load(tmp_path):
    folder = config_folder(tmp_path, TINY)
    first, tokenizer, _ = load_checkpoint(folder, torch.float32, CPU, "dummy")
    again, _, _ = load_checkpoint(folder, torch.float32, CPU, "dummy")
    weights = first.state_dict()
    assert weights.keys() == again.state_dict().keys()
    assert all(torch.equal(weights[key], again.state_dict()[key]) for key in weights)
    projection = first.hf_state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert projection.std() > 0 and torch.isfinite(projection).all()
    assert tokenizer is None, "a vocabulary of 96 cannot hold the byte tokenizer's 257 ids"


def test_a_config_only_folder_gets_the_byte_tokenizer_when_its_vocabulary_holds_it(tmp_path):
    folder = config_folder(tmp_path, TINY | {"vocab_size": 300})
    _, tokenizer, _ = load_checkpoint(folder, torch.float32, CPU, "dummy")
    assert tokenizer.encode("A\u00e9").ids == list("A\u00e9".encode())


def test_dummy_ignores_the_weights_present_and_says_so(tmp_path, capsys):
    folder = tmp_path / "vkv-tiny"
    shutil.copytree(DEFAULT_MODEL, folder)
    engine = LLMEngine(folder, load_format="dummy", max_num_seqs=2, max_model_len=64)
    trained = LLMEngine(folder, max_num_seqs=2, max_model_len=64)
    name = "model.embed_tokens.weight"
    assert not torch.equal(engine.model.state_dict()[name], trained.model.state_dict()[name])
    assert "random weights (--load-format dummy, the folder's 1 *.safetensors ignored)" in (
        capsys.readouterr().err
    )
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    request = engine.add_request("def f(x):", params)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.sequence(request).completion_token_ids) == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--load-format", "dummy"], "is not a checkpoint folder: config.json is missing"),
        (["--device", "cuda"], "torch sees no CUDA GPU on this machine"),
    ],
    ids=["no-config", "no-cuda"],
)
def test_a_bad_model_option_is_one_line_and_a_failure(tmp_path, capsys, argv, message):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code = main(["bench", "e2e", "--model", str(tmp_path), *argv, "--requests", "1"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    if "dummy" in argv:
        assert str(tmp_path) in err


def test_an_unknown_load_format_or_dtype_names_the_choices():
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy"):
        load_checkpoint(None, torch.float32, CPU, "random")
    with pytest.raises(ValueError, match="dtype must be one of auto, float32"):
        LLMEngine(dtype="fp8")


def test_llama3_rotary_scaling_matches_transformers():
    scaling = {
        "rope_type": "llama3",
        "rope_theta": 10_000.0,
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,  # short: every regime among 8 frequencies
    }
    hf = tiny_hf_model("llama", rope_parameters=scaling)
    config = ModelConfig.from_hf(hf.config.to_dict())
    assert config.rope_scaling is not None
    ours = CausalLM(config).eval()
    ours.load_hf_state_dict(hf.state_dict())
    tokens = torch.tensor([(5 * i + 3) % 96 for i in range(40)])
    block_size = 8
    caches = [(torch.zeros(5, block_size, 2, 16), torch.zeros(5, block_size, 2, 16)) for _ in "kv"]
    meta = AttentionMetadata(
        is_prefill=True,
        slot_mapping=torch.arange(len(tokens)),
        block_tables=torch.arange(5, dtype=torch.int32)[None, :],
        context_lens=torch.tensor([len(tokens)], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, len(tokens)], dtype=torch.int32),
    )
    with torch.no_grad():
        logits = ours(tokens, torch.arange(len(tokens)), caches, meta, reference)
        expected = hf(tokens[None]).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_an_unknown_rotary_scaling_is_refused():
    with pytest.raises(ValueError, match="plain RoPE or llama3 only"):
        ModelConfig.from_hf(TINY | {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="lacks 'low_freq_factor'"):
        ModelConfig.from_hf(TINY | {"rope_scaling": {"rope_type": "llama3", "factor": 2.0}})


@pytest.mark.parametrize("command", [["generate", "x"], ["serve"], ["bench", "e2e"]])
def test_every_command_that_runs_a_model_takes_the_model_options(command):
    options = ["--load-format", "dummy", "--dtype", "float32", "--device", "cpu", "--model", "m"]
    args = _parser().parse_args([*command, *options])
    assert (args.load_format, args.dtype, args.device, args.model) == (
        "dummy",
        "float32",
        "cpu",
        "m",
    )


def test_generate_runs_on_random_weights_of_a_config_only_folder(tmp_path, capsys):
    folder = config_folder(tmp_path, TINY | {"vocab_size": 300})
    argv = ["generate", "def f(x):", "--max-tokens", "4", "--device", "cpu"]
    assert main([*argv, "--load-format", "dummy", "--model", str(folder)]) == 0
    captured = capsys.readouterr()
    assert "def f(x):" in captured.out and "random weights (--load-format dummy)" in captured.err
