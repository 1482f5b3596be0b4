"""A step's block tables as rows of an int32 array, kept from step to step (given).

The model reads block tables as one padded ``[sequences, width]`` int32 tensor, -1 past each
sequence's blocks. Converting every table from Python ints each step costs about 15 ns an entry:
at 128 sequences of 1,000 tokens (8,000 entries in blocks of 16) some 120-400 microseconds a
step, which a GPU replaying its decode step from a CUDA graph waits for. Yet a decode step
changes few tables: a sequence gains a block every ``block_size`` tokens. So the rows stay in
one array across steps, and a step compares each table with the copy its row was written from
(a C-level list comparison: about 60 ns a row when nothing changed) and rewrites only the rows
that differ, as vLLM V1 keeps its block tables in its persistent batch.

Invariant: row ``i`` holds ``rows[i]`` followed by -1, and every row past ``len(rows)`` is all -1
(a padded row of a CUDA-graph batch reads no block).
"""

import numpy as np


class StagedTables:
    """Block tables staged into ``array`` (``[rows, max_blocks]`` int32, all -1 at first; none
    given: an empty one, which ``padded`` grows), rewritten row by row where a table changed."""

    def __init__(self, array: np.ndarray | None = None) -> None:
        self.array = np.full((0, 0), -1, np.int32) if array is None else array
        self.rows: list[list[int]] = []  # the table each row was written from (a copy)

    def padded(self, tables: list[list[int]]) -> np.ndarray:
        """``tables`` padded with -1 to the longest, as a new ``[len(tables), width]`` array,
        taken from the rows staged here (the array replaced by a larger one, every row written
        anew, when ``tables`` do not fit)."""
        rows, width = len(tables), max(map(len, tables), default=0)
        held_rows, held_width = self.array.shape
        if rows > held_rows or width > held_width:
            shape = (max(rows, held_rows), max(width, held_width))
            self.array, self.rows = np.full(shape, -1, np.int32), []
        self.stage(tables)
        return self.array[:rows, :width].copy()  # the staged rows change with the next step

    def stage(self, tables: list[list[int]]) -> None:
        """Make row ``i`` hold ``tables[i]`` (then -1) and every later row -1."""
        array, rows = self.array, self.rows
        for index, table in enumerate(tables):
            known = index < len(rows)
            held = rows[index] if known else []
            if known and held == table:
                continue
            array[index, : len(table)] = table  # first: a table that does not fit is not recorded
            array[index, len(table) : len(held)] = -1  # a shorter table: clear the rest
            if known:
                rows[index] = list(table)
            else:
                rows.append(list(table))
        for index in range(len(tables), len(rows)):
            array[index, : len(rows[index])] = -1
        del rows[len(tables) :]
