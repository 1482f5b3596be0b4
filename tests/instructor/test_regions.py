"""Solution regions: parsing, stubbing and restoring (instructor tooling, not graded)."""

import ast
import textwrap

import pytest

from vkv.assignment.regions import RegionError, find_regions, restore_regions, stub_regions

SOURCE = textwrap.dedent(
    '''
    class Pool:
        def take(self, n):
            """Take n."""
            ### BEGIN SOLUTION part1.2
            if n < 0:
                raise ValueError(n)
            return n
            ### END SOLUTION

        @property
        def size(self):
            ### BEGIN SOLUTION part1.3
            return 3
            ### END SOLUTION


    def helper():
        x = 1
        ### BEGIN SOLUTION part1.2
        x += 1
        ### END SOLUTION
        return x
    '''
)


def test_find_regions_reports_part_function_and_body():
    regions = find_regions(SOURCE)
    assert [(r.part, r.qualname) for r in regions] == [
        ("1.2", "Pool.take"),
        ("1.3", "Pool.size"),
        ("1.2", "helper"),
    ]
    assert regions[0].dedented_body() == "if n < 0:\n    raise ValueError(n)\nreturn n"
    assert regions[2].indent == "    "


def test_stub_replaces_only_the_chosen_parts_and_keeps_markers():
    stubbed = stub_regions(SOURCE, {"1.2"})
    ast.parse(stubbed)
    regions = find_regions(stubbed)
    assert [r.is_stub for r in regions] == [True, False, True]
    assert regions[0].body == (
        '        raise NotImplementedError("part 1.2: Pool.take — assignment/phase1.md#part-2")',
    )
    assert "x = 1" in stubbed and "return x" in stubbed, "code outside regions stays"


def test_restore_puts_the_reference_back_exactly():
    stubbed = stub_regions(SOURCE, {"1.2", "1.3"})
    assert restore_regions(stubbed, SOURCE, {"1.2", "1.3"}) == SOURCE
    partly = restore_regions(stubbed, SOURCE, {"1.3"})
    assert [r.is_stub for r in find_regions(partly)] == [True, False, True]


def test_restore_refuses_a_file_whose_regions_were_moved():
    stubbed = stub_regions(SOURCE, {"1.2"})
    damaged = stubbed.replace("### BEGIN SOLUTION part1.3", "### BEGIN SOLUTION part1.4")
    with pytest.raises(RegionError, match="differ from the reference"):
        restore_regions(damaged, SOURCE, {"1.2"})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("def f():\n    ### BEGIN SOLUTION part1.1\n    pass\n", "never closed"),
        ("def f():\n    pass\n    ### END SOLUTION\n", "without BEGIN"),
        (
            "def f():\n    ### BEGIN SOLUTION part1.1\n    ### BEGIN SOLUTION part1.1\n"
            "    pass\n    ### END SOLUTION\n    ### END SOLUTION\n",
            "inside another",
        ),
        ("### BEGIN SOLUTION part1.1\nx = 1\n### END SOLUTION\n", "inside a function"),
        ("def f():\n    ### BEGIN SOLUTION part one\n    pass\n", "malformed marker"),
    ],
)
def test_malformed_markers_are_reported_with_their_line(text, message):
    with pytest.raises(RegionError, match=message):
        find_regions(text, "m.py")


def test_a_marker_inside_a_string_is_text_not_a_marker():
    """Markers are the comments the tokenizer finds, as the parser reads the file."""
    text = 'def f():\n    s = """\n    ### BEGIN SOLUTION part1.1\n    """\n    return s\n'
    assert find_regions(text) == []


def test_a_marker_after_code_on_its_line_is_refused():
    text = "def f():\n    x = 1  ### BEGIN SOLUTION part1.1\n    ### END SOLUTION\n"
    with pytest.raises(RegionError, match=r"m.py:2: a marker must stand alone on its line"):
        find_regions(text, "m.py")


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\r", "\x1e"])
def test_a_line_break_other_than_newline_is_refused_with_its_line(separator):
    text = SOURCE + f"# a comment{separator}import os\n"
    line = text.count("\n")
    with pytest.raises(RegionError, match=rf"m.py:{line}: a line break other than \\n: U\+"):
        find_regions(text, "m.py")


def test_windows_line_endings_are_named():
    with pytest.raises(RegionError, match=r"m.py:1: .*\\r\\n \(Windows line endings\)"):
        find_regions("def f():\r\n    pass\r\n", "m.py")


@pytest.mark.parametrize("ending", ["", "\n", "\n\n"])
def test_a_rebuild_keeps_every_byte_outside_the_regions(ending):
    """Stub then restore gives the file back byte for byte, however it ends."""
    text = SOURCE.rstrip("\n") + "\n# tail  \t" + ending
    assert restore_regions(stub_regions(text, {"1.2", "1.3"}), text, {"1.2", "1.3"}) == text
