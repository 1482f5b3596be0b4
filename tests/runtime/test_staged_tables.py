"""Block tables staged across steps (``StagedTables``): after every step the array is exactly
the step's tables padded with -1 (and -1 below them), whatever the steps before held, and a
table that did not change is not written again."""

import random

import numpy as np
import pytest

from vkv.engine.staged_tables import StagedTables

ROWS, WIDTH = 6, 8


def padded(tables: list[list[int]]) -> np.ndarray:
    expected = np.full((ROWS, WIDTH), -1, np.int32)
    for index, table in enumerate(tables):
        expected[index, : len(table)] = table
    return expected


def changed(tables: list[list[int]], rng: random.Random) -> list[list[int]]:
    """The next step's tables: a block gained, a copy on write of the last block, a table
    swapped in anew or shortened, sequences gone or come, the batch reordered."""
    tables = [list(table) for table in tables]
    for table in tables:
        kind = rng.randrange(5)
        if kind == 0 and len(table) < WIDTH:
            table.append(rng.randrange(100))
        elif kind == 1 and table:
            table[-1] = rng.randrange(100)
        elif kind == 2:
            table[:] = [rng.randrange(100) for _ in range(rng.randint(1, WIDTH))]
        elif kind == 3:
            del table[rng.randint(1, max(1, len(table))) :]
    if rng.random() < 0.3:
        rng.shuffle(tables)
    keep = rng.randint(0, ROWS)
    tables = tables[:keep]
    while len(tables) < keep:
        tables.append([rng.randrange(100) for _ in range(rng.randint(1, WIDTH))])
    return tables


@pytest.mark.parametrize("seed", range(20))
def test_every_step_leaves_exactly_its_tables_padded(seed):
    rng = random.Random(seed)
    staged = StagedTables(np.full((ROWS, WIDTH), -1, np.int32))
    tables: list[list[int]] = []
    for _ in range(40):
        tables = changed(tables, rng)
        staged.stage(tables)
        np.testing.assert_array_equal(staged.array, padded(tables))


def test_a_table_that_did_not_change_is_not_written_again():
    staged = StagedTables(np.full((ROWS, WIDTH), -1, np.int32))
    tables = [[1, 2], [3], [4, 5, 6]]
    staged.stage(tables)
    copies = list(staged.rows)
    staged.array[0, 0] = 99  # a stray write: only a rewrite of row 0 would mend it
    tables[1].append(7)  # the sequence's own list grows: its row is rewritten
    staged.stage(tables)
    assert staged.rows[0] is copies[0] and staged.rows[2] is copies[2]
    assert staged.array[0, 0] == 99, "row 0's table is unchanged: not written"
    assert staged.rows[1] == [3, 7] and staged.rows[1] is not tables[1], "a copy is kept"
    np.testing.assert_array_equal(staged.array[1:3], padded(tables)[1:3])


def test_no_tables_clear_every_row():
    staged = StagedTables(np.full((ROWS, WIDTH), -1, np.int32))
    staged.stage([[1, 2, 3], [4]])
    staged.stage([])
    assert (staged.array == -1).all() and staged.rows == []


def test_padded_grows_the_array_and_returns_a_copy_of_the_rows():
    staged = StagedTables()
    first = staged.padded([[1, 2], [3]])
    np.testing.assert_array_equal(first, [[1, 2], [3, -1]])
    wider = staged.padded([[1, 2], [3], [4, 5, 6, 7]])  # more rows and wider: a new array
    np.testing.assert_array_equal(wider, [[1, 2, -1, -1], [3, -1, -1, -1], [4, 5, 6, 7]])
    narrower = staged.padded([[8]])
    np.testing.assert_array_equal(narrower, [[8]])
    np.testing.assert_array_equal(first, [[1, 2], [3, -1]])  # a copy: later steps leave it be
    assert staged.array.shape == (3, 4) and (staged.array[1:] == -1).all()


def test_a_table_that_does_not_fit_is_refused_each_time_and_leaves_no_record():
    staged = StagedTables(np.full((2, 3), -1, np.int32))
    staged.stage([[1]])
    for _ in range(2):  # refused again: nothing recorded the first time
        with pytest.raises(ValueError):
            staged.stage([[1, 2, 3, 4]])
    for _ in range(2):
        with pytest.raises(IndexError):
            staged.stage([[1], [2], [3]])
    staged.stage([[5, 6]])
    np.testing.assert_array_equal(staged.array, [[5, 6, -1], [-1, -1, -1]])
