"""What the ``vkv`` command says: help text without markup, errors in the units asked for."""

import pytest

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
