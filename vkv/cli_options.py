"""The options that every model command shares (``vkv generate``, ``demo``, ``serve``,
``bench e2e``): which checkpoint, weights, dtype and device, and how the KV cache is kept; and
the engine's keyword arguments they stand for."""

import argparse

from vkv.config import GRANULARITIES, KV_CACHE_DTYPES, LOAD_FORMATS, MODEL_DTYPES, QUANT_GROUPS
from vkv.models import SHAPES


def add_model_options(command: argparse.ArgumentParser) -> None:
    """Which model runs, with which weights, in which dtype, on which device: the same for
    every command that serves a checkpoint."""
    command.add_argument(
        "--model", help="a Hugging Face checkpoint folder (default: the built-in vkv-tiny)"
    )
    command.add_argument(
        "--load-format",
        choices=list(LOAD_FORMATS),
        default="auto",
        help="dummy: random weights of the shape in --model's config.json, no weights needed "
        f"(real models' shapes ship in {SHAPES})",
    )
    command.add_argument(
        "--dtype",
        choices=list(MODEL_DTYPES),
        default="auto",
        help="the weights' and the KV cache's dtype (auto: float16 on CUDA, float32 on a CPU)",
    )
    command.add_argument(
        "--device", choices=["cpu", "cuda"], help="default: cuda where there is one, else cpu"
    )
    command.add_argument(
        "--enforce-eager",
        action="store_true",
        help="launch every op of a decode step eagerly (default on CUDA: replay CUDA graphs)",
    )


def model_arguments(args: argparse.Namespace) -> dict[str, str | None]:
    """The engine's keyword arguments for the options of ``add_model_options``."""
    return {
        "load_format": args.load_format,
        "dtype": args.dtype,
        "device": args.device,
        "enforce_eager": args.enforce_eager,
    }


def add_kv_cache_options(command: argparse.ArgumentParser) -> None:
    """The KV-cache options (formats, Phase 3; prefix caching, Phase 4; the heads' split over
    processes), the same for every command that runs the model."""
    command.add_argument(
        "--kv-cache-dtype",
        choices=list(KV_CACHE_DTYPES),
        default="auto",
        help="store the KV cache quantized (int8, int4): the same bytes hold more blocks",
    )
    command.add_argument(
        "--key-granularity",
        choices=list(GRANULARITIES),
        default="per_token",
        help="with int8 / int4: quantize keys per token and head, or per channel over each block "
        "(KIVI: a block's keys wait in full precision until it fills)",
    )
    command.add_argument(
        "--kv-quant-group",
        choices=list(QUANT_GROUPS),
        default="head",
        help="with int8 / int4: a per-token scale covers one KV head, or all of a token's "
        "(fewer scales: more blocks, a little less precision)",
    )
    command.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="share the KV blocks of prompt prefixes computed before (a radix tree of blocks)",
    )
    command.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split the model's heads and the KV cache over N processes (torch.distributed)",
    )


def kv_budget_bytes(args: argparse.Namespace) -> int | None:
    """``--kv-budget-mb`` in bytes; None leaves the engine's own budget."""
    return None if args.kv_budget_mb is None else int(args.kv_budget_mb * 2**20)


def kv_cache_arguments(args: argparse.Namespace) -> dict[str, str | bool | int]:
    """The engine's keyword arguments for the options of ``add_kv_cache_options``."""
    return {
        "kv_cache_dtype": args.kv_cache_dtype,
        "key_granularity": args.key_granularity,
        "kv_quant_group": args.kv_quant_group,
        "enable_prefix_caching": args.enable_prefix_caching,
        "tensor_parallel_size": args.tensor_parallel_size,
    }
