"""``vkv.kernels.layer_ops`` against its PyTorch definitions, and the CPU backend's KV store.

Each fused operation has three implementations: the PyTorch composition that defines it, a C
loop (a CPU, float32) and a Triton kernel (a GPU; here under the interpreter where there is
none). Each is compared with a float64 computation of the definition, on the layouts the model
hands them: q, k and v as slices of one projection's rows, head sizes that are and are not a
multiple of 8, Qwen3's q/k norm and Llama's none, the residual stream's first layer (no stream
yet) and the others. The C loops are required where ``VKV_REQUIRE_CPU_KERNEL=1``.
"""

import os

import pytest
import torch
from devices import KERNEL_DEVICE

from vkv.engine.llm_engine import LLMEngine
from vkv.kernels import cpu_attention, cpu_library, layer_ops, reference
from vkv.models.qwen3 import RotaryTable
from vkv.sampling_params import SamplingParams

HAVE_LIBRARY = cpu_library.library() is not None
needs_library = pytest.mark.skipif(
    not HAVE_LIBRARY and os.environ.get("VKV_REQUIRE_CPU_KERNEL") != "1",
    reason="no C compiler to build the CPU library (VKV_REQUIRE_CPU_KERNEL=1 fails instead)",
)
EPS = 1e-6
IMPLEMENTATIONS = pytest.mark.parametrize(
    ("path", "dtype"),
    [
        ("c", torch.float32),
        ("torch", torch.float32),
        ("triton", torch.float32),
        ("triton", torch.float16),
    ],
)


def run_on(path, monkeypatch):
    """Make ``layer_ops`` take ``path``; the device its tensors go on."""
    if path == "c" and not HAVE_LIBRARY:
        pytest.fail("no compiled CPU library: is a C compiler (cc) installed?")
    monkeypatch.setattr(layer_ops, "_path", lambda x: path)
    return KERNEL_DEVICE if path == "triton" else "cpu"


def assert_close_to(got, expected64, dtype):
    """Within a few units in the last place of ``dtype`` (the float64 answer's magnitude)."""
    eps = torch.finfo(dtype).eps
    error = (got.cpu().double() - expected64).abs()
    bound = 4 * eps * (expected64.abs() + 1)
    assert (error <= bound).all(), (
        f"off by {float(error.max()):.3g} (bound {float(bound.max()):.3g})"
    )


def rms_norm64(x, weight):
    x = x.double()
    return x / (x.pow(2).mean(-1, keepdim=True) + EPS).sqrt() * weight.double()


@pytest.mark.parametrize("first_layer", [True, False], ids=["no-stream-yet", "stream"])
@pytest.mark.parametrize("hidden", [64, 20])
@IMPLEMENTATIONS
def test_add_rms_norm_adds_to_the_stream_and_normalizes_it(
    path, dtype, hidden, first_layer, monkeypatch
):
    device = run_on(path, monkeypatch)
    generator = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=generator).to(dtype)
    stream = None if first_layer else torch.randn(5, hidden, generator=generator).to(dtype)
    weight = (torch.rand(hidden, generator=generator) + 0.5).to(dtype)
    expected_stream = x.double() if first_layer else (x.double() + stream.double())
    args = [t.to(device) if t is not None else None for t in (x, stream, weight)]
    out, new_stream = layer_ops.add_rms_norm(args[0], args[1], args[2], EPS)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close_to(new_stream, expected_stream, dtype)
    if not first_layer:
        assert new_stream is args[1], "the stream is updated in place"
    assert_close_to(out, rms_norm64(expected_stream.to(dtype), weight), dtype)


def turned64(x, positions, table, weight):
    """The definition in float64: normalized (with a weight), then turned by position."""
    x = x.double() if weight is None else rms_norm64(x, weight)
    cos = table.cos.double()[positions][:, None]
    sin = table.signed_sin.double()[positions][:, None]
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("head_dim", [32, 20])
@IMPLEMENTATIONS
def test_qk_norm_rotary_turns_the_heads_of_a_projection_in_place(
    path, dtype, head_dim, qk_norm, monkeypatch
):
    device = run_on(path, monkeypatch)
    generator = torch.Generator().manual_seed(head_dim)
    tokens, q_heads, kv_heads = 6, 4, 2
    widths = (q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    qkv = torch.randn(tokens, sum(widths), generator=generator).to(dtype).to(device)
    before = qkv.clone()
    q, k, v = qkv.split(widths, -1)
    q = q.view(tokens, q_heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 7, 3, 300, 1, 299]).to(device)
    table = RotaryTable(head_dim, 10_000.0, None)
    table.reserve(301, torch.device(device), dtype)
    weights = [(torch.rand(head_dim, generator=generator) + 0.5).to(dtype) for _ in range(2)]
    q_weight, k_weight = [w.to(device) for w in weights] if qk_norm else (None, None)
    expected_q, expected_k = (
        turned64(part.cpu().view(tokens, -1, head_dim), positions.cpu(), table_cpu, w)
        for part, table_cpu, w in (
            (before[:, : widths[0]], _on_cpu(table), weights[0] if qk_norm else None),
            (before[:, widths[0] : -widths[2]], _on_cpu(table), weights[1] if qk_norm else None),
        )
    )
    layer_ops.qk_norm_rotary(q, k, positions, table.cos, table.signed_sin, q_weight, k_weight, EPS)
    assert_close_to(q, expected_q, dtype)
    assert_close_to(k, expected_k, dtype)
    assert torch.equal(v, before[:, -widths[2] :]), "v, beside them in the row, is untouched"


def _on_cpu(table):
    copy = RotaryTable(table.head_dim, table.theta, table.scaling)
    copy.cos, copy.signed_sin = table.cos.cpu(), table.signed_sin.cpu()
    return copy


@pytest.mark.parametrize("width", [48, 5])
@IMPLEMENTATIONS
def test_silu_and_mul_multiplies_the_activated_gate_by_up(path, dtype, width, monkeypatch):
    device = run_on(path, monkeypatch)
    x = (4 * torch.randn(3, 2 * width, generator=torch.Generator().manual_seed(width))).to(dtype)
    out = layer_ops.silu_and_mul(x.to(device))
    gate, up = x.double().chunk(2, -1)
    assert out.shape == (3, width) and out.dtype == dtype
    assert_close_to(out, gate * torch.sigmoid(gate) * up, dtype)


def test_the_rotary_table_is_built_once_for_a_run_and_grows_by_doubling(monkeypatch):
    """cos and sin are cached by position: a run's steps reuse the table its first step built
    (256 rows cover every position here), and a step past the table at least doubles it,
    keeping the rows it had."""
    built: list[int] = []
    build = RotaryTable._build

    def counted(self, length, device, dtype):
        built.append(length)
        build(self, length, device, dtype)

    monkeypatch.setattr(RotaryTable, "_build", counted)
    engine = LLMEngine(device="cpu", num_gpu_blocks=64, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for prompt in ("def add(a, b):\n", "import os\n"):
        engine.add_request(prompt, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps >= 40 and built == [256]

    table = engine.model.rotary
    before = table.cos.clone(), table.signed_sin.clone()
    table.reserve(256, torch.device("cpu"), torch.float32)
    assert built == [256], "a table that covers the step is kept"
    table.reserve(257, torch.device("cpu"), torch.float32)
    assert built == [256, 512] and len(table.cos) == 512
    assert torch.equal(table.cos[:256], before[0])
    assert torch.equal(table.signed_sin[:256], before[1])


@needs_library
def test_a_position_past_the_rotary_table_is_refused():
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    table = RotaryTable(8, 10_000.0, None)
    table.reserve(4, torch.device("cpu"), torch.float32)
    with pytest.raises(IndexError, match="position"):
        layer_ops.qk_norm_rotary(
            q, k, torch.tensor([1, len(table.cos)]), table.cos, table.signed_sin, None, None, EPS
        )


@needs_library
def test_the_c_store_writes_what_the_reference_writes_and_skips_padding():
    generator = torch.Generator().manual_seed(3)
    tokens, kv_heads, head_dim = 7, 2, 12
    kv = torch.randn(tokens, 3 * kv_heads * head_dim, generator=generator)
    key, value = (
        part.view(tokens, kv_heads, head_dim) for part in kv.split(kv_heads * head_dim, -1)[1:]
    )
    slots = torch.tensor([5, -1, 0, 17, -1, 9, 2])
    caches = [torch.randn(5, 4, kv_heads, head_dim, generator=generator) for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    reference.store_kvcache(key, value, *expected, slots)
    cpu_attention.store_kvcache(key, value, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    with pytest.raises(IndexError, match="past the cache"):
        cpu_attention.store_kvcache(key, value, *caches, torch.tensor([0, 1, 2, 3, 4, 5, 20]))


@needs_library
def test_decode_attention_reads_strided_queries_and_gives_an_empty_context_zeros():
    generator = torch.Generator().manual_seed(4)
    rows = torch.randn(3, 2 * 4 * 16, generator=generator)
    query = rows[:, : 4 * 16].view(3, 4, 16)  # q of a projection's rows: 128 floats apart
    cache = torch.randn(6, 4, 2, 16, generator=generator)
    tables = torch.tensor([[0, 1], [2, -1], [-1, -1]], dtype=torch.int32)
    lens = torch.tensor([7, 3, 0], dtype=torch.int32)
    args = (cache, cache, tables, lens, 0.25)
    ours = cpu_attention.paged_decode_attention(query, *args)
    assert torch.allclose(
        ours, reference.paged_decode_attention(query.contiguous(), *args), atol=1e-6
    )
    assert torch.equal(ours[2], torch.zeros(4, 16)), "a context of 0 attends to nothing"


def test_without_the_library_every_op_is_its_definition(monkeypatch):
    monkeypatch.setattr(cpu_library, "library", lambda: None)
    x, weight = torch.randn(3, 8), torch.rand(8)
    assert torch.equal(
        layer_ops.add_rms_norm(x, None, weight, EPS)[0],
        layer_ops.add_rms_norm_reference(x, None, weight, EPS)[0],
    )
    assert torch.equal(layer_ops.silu_and_mul(x), layer_ops.silu_and_mul_reference(x))
