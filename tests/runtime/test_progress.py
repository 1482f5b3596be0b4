"""The engine runs on the parts a student has done: ``vkv.assignment.progress``.

A tree's unfinished parts are read from its stubbed regions; the engine refuses, naming the
part, an option that runs an unfinished one, and runs without metrics while Phase 5's logger is
a stub.
"""

import shutil
from pathlib import Path

import pytest

from vkv import LLM, SamplingParams
from vkv.assignment import progress
from vkv.assignment.parts import MANIFEST, Assignment
from vkv.assignment.regions import find_regions, stub_regions
from vkv.cli import main
from vkv.engine.llm_engine import LLMEngine

ROOT = Path(__file__).resolve().parents[2]
PART_FILES = {
    region.part: name
    for name in Assignment.load(ROOT).editable
    for region in find_regions((ROOT / name).read_text(), name)
}


def tree_with_stubs(tmp_path: Path, parts: set[str]) -> Path:
    """A copy of this tree's manifest and editable files with ``parts`` stubbed."""
    assignment = Assignment.load(ROOT)
    (tmp_path / MANIFEST).parent.mkdir(parents=True)
    shutil.copy(ROOT / MANIFEST, tmp_path / MANIFEST)
    for name in assignment.editable:
        target = tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(stub_regions((ROOT / name).read_text(), parts, name))
    return tmp_path


def test_the_reference_has_no_unfinished_part():
    assert progress.unfinished_parts() == {}


def test_unfinished_parts_are_the_stubbed_ones_in_the_manifests_order(tmp_path):
    tree = tree_with_stubs(tmp_path, {"5.1", "1.3", "2.2"})
    unfinished = progress.unfinished_parts(tree)
    assert list(unfinished) == ["1.3", "2.2", "5.1"]
    assert unfinished["1.3"][0] == "vkv/engine/block_manager.py"
    assert unfinished["5.1"] == ("vkv/metrics/stats.py", "StatLogger.record_step")


def test_a_tree_without_a_manifest_or_with_broken_markers_counts_as_done(tmp_path):
    assert progress.unfinished_parts(tmp_path) == {}
    tree = tree_with_stubs(tmp_path / "t", {"1.2"})
    broken = tree / "vkv/engine/block.py"
    broken.write_text(broken.read_text().replace("### END SOLUTION", "", 1))
    assert "1.2" not in progress.unfinished_parts(tree)


@pytest.fixture
def unfinished(monkeypatch):
    """Pretend the tree this package runs from has these parts stubbed."""

    def pretend(*parts: str) -> None:
        fake = {part: (PART_FILES[part], f"Stub.part_{part}") for part in parts}
        monkeypatch.setattr(progress, "unfinished_parts", lambda root=None: fake)

    return pretend


def test_without_phase_5s_logger_the_engine_runs_without_metrics_and_says_so(unfinished, capfd):
    unfinished("5.1", "5.3")
    llm = LLM(max_num_seqs=2)
    [out] = llm.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out["token_ids"]) == 3
    llm.engine.abort(llm.engine.add_request("abc"))  # abort records nothing either
    assert llm.engine.stat_logger is None
    lines = [line for line in capfd.readouterr().err.splitlines() if "metrics" in line]
    assert lines == ["vkv: metrics off until part 5.1 (Stub.part_5.1) is done"]


@pytest.mark.parametrize(
    ("options", "part", "what"),
    [
        ({}, "1.1", "the engine (its Sequence, BlockManager and Scheduler)"),
        (  # the backend named: on a GPU the engine's default is triton
            {"kv_cache_dtype": "int8", "backend": "torch"},
            "3.2",
            "a quantized KV cache (--kv-cache-dtype int8) on the torch backend",
        ),
        (
            {"kv_cache_dtype": "int4", "backend": "torch"},
            "3.2",
            "a quantized KV cache (--kv-cache-dtype int4) on the torch backend",
        ),
        (
            {"kv_cache_dtype": "int8", "backend": "triton"},
            "3.8",
            "a quantized KV cache (--kv-cache-dtype int8) on the triton backend",
        ),
        ({"enable_prefix_caching": True}, "4.4", "prefix caching (--enable-prefix-caching)"),
    ],
)
def test_an_option_that_runs_an_unfinished_part_is_refused_naming_it(
    unfinished, options, part, what
):
    unfinished(part, "5.1")
    phase, number = part.split(".")
    with pytest.raises(NotImplementedError) as raised:
        LLMEngine(num_gpu_blocks=8, **options)
    assert str(raised.value) == (
        f"part {part}: Stub.part_{part} is not done yet, and {what} runs it "
        f"(assignment/phase{phase}.md#part-{number})"
    )


def test_a_16_bit_cache_without_caching_needs_neither_phase_3_nor_phase_4(unfinished):
    unfinished("3.1", "3.2", "4.1", "4.4", "5.1")
    engine = LLMEngine(num_gpu_blocks=8)
    assert engine.config.kv_cache_dtype == "auto"
    assert not engine.config.enable_prefix_caching


def test_the_torch_backend_takes_a_quantized_cache_before_the_triton_part_is_done(unfinished):
    unfinished("3.8", "5.1")
    engine = LLMEngine(num_gpu_blocks=8, kv_cache_dtype="int8", backend="torch")
    assert engine.config.kv_cache_dtype == "int8"


def test_the_cli_prints_an_unfinished_part_in_one_line(unfinished, capsys):
    unfinished("4.4")
    assert main(["generate", "hi", "--enable-prefix-caching", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: part 4.4: Stub.part_4.4 is not done yet") and "\n" not in err
