"""Config and SamplingParams validation (provided code, not graded)."""

import pytest

from vkv.config import Config, PreemptionMode
from vkv.engine.radix_cache import RadixCache
from vkv.sampling_params import SamplingParams


def test_defaults_follow_vllm_v0():
    config = Config()
    assert config.token_budget == 4096, "max(max_model_len, 2048) without chunked prefill"
    assert Config(enable_chunked_prefill=True).token_budget == 2048
    assert config.preemption_mode is PreemptionMode.AUTO
    assert Config(preemption_mode="swap").preemption_mode is PreemptionMode.SWAP


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block_size": 0}, "block_size"),
        ({"num_gpu_blocks": -1}, "num_gpu_blocks"),
        ({"num_cpu_blocks": -1}, "num_cpu_blocks"),
        ({"watermark": 1.5}, "watermark"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"preemption_mode": "later"}, "preemption_mode"),
        (
            {"max_num_seqs": 64, "max_num_batched_tokens": 32, "max_model_len": 16},
            ">= max_num_seqs",
        ),
        ({"max_model_len": 8192, "max_num_batched_tokens": 4096}, "chunked prefill"),
    ],
)
def test_bad_options_name_themselves(options, message):
    with pytest.raises(ValueError, match=message):
        Config(**options)


def test_chunked_prefill_allows_a_budget_below_max_model_len():
    config = Config(max_model_len=8192, max_num_batched_tokens=512, enable_chunked_prefill=True)
    assert config.token_budget == 512


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_sampling_params_name_themselves(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)


def test_greedy_is_temperature_zero():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams().greedy


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"seed": 1.5}, "seed must be an integer"),
        ({"seed": 2**63}, r"seed must be in \[0, 2\*\*63\)"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*63\)"),
        ({"seed": True}, "seed must be an integer"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer"),
        ({"max_tokens": float("nan")}, "max_tokens must be an integer"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": float("nan")}, "top_p must be a finite number"),
        ({"top_k": 2.0}, "top_k must be an integer"),
        ({"ignore_eos": "yes"}, "ignore_eos must be True or False"),
    ],
)
def test_sampling_params_refuse_wrong_types_and_non_finite_values(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)


def test_the_largest_seed_is_accepted():
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1


@pytest.mark.parametrize("block_size", [0, -1, 2.0, True, "16"])
def test_a_radix_cache_refuses_a_bad_block_size(block_size):
    with pytest.raises(ValueError, match="block_size must be a positive integer, got"):
        RadixCache(block_size)
