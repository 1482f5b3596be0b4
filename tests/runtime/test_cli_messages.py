"""What the ``vkv`` command says: help text without markup, errors in the units asked for."""

import pytest

from vkv import LLM, SamplingParams
from vkv import llm as llm_module
from vkv.cli import main


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out
    assert "generate text (default model: the built-in vkv-tiny)" in out


def test_generate_help_names_the_built_in_model(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "generate text (default model: the built-in vkv-tiny)" in out
    assert "with a checkpoint folder" not in out


@pytest.mark.parametrize("blocks", ["0", "-3"])
def test_a_demo_without_a_block_is_refused_in_blocks(blocks, capsys):
    assert main(["demo", "--gpu-blocks", blocks, "--no-live"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: the device KV pool (--gpu-blocks) must be >= 1 block, got {blocks}"


def test_generate_piped_prints_the_text_first_without_a_progress_line(capfd):
    assert main(["generate", "def f", "--max-tokens", "4"]) == 0
    out = capfd.readouterr().out
    assert out.startswith("def f"), f"piped, the output starts with the prompt: {out[:40]!r}"


def test_the_progress_bar_counts_tokens_as_they_come(monkeypatch):
    advances = []

    class Recorder:
        def __init__(self, **options):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def add_task(self, name, total):
            self.total = total
            return 0

        def advance(self, task, amount):
            advances.append((amount, self.total))

    monkeypatch.setattr(llm_module, "Progress", Recorder)
    llm = LLM(max_num_seqs=2)
    llm.generate(["ab", "cd"], SamplingParams(max_tokens=6, ignore_eos=True))
    assert sum(amount for amount, _ in advances) == advances[0][1] == 12
    assert len([amount for amount, _ in advances if amount]) >= 6, "a step at a time"
