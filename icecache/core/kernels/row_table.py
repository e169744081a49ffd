"""Several sequences in one kernel launch: a batch's rows, each on tensors of its own, addressed from the first row's.

A batched decode step (``core.batch``) hands each row to its own sequence's layer, whose buffers were allocated when
the row was prefilled, apart from the other rows'. A kernel that serves every row of the batch in one launch takes
row 0's tensors as its pointer arguments and a ``RowTable``: ``offsets[b, c]`` is the distance, in elements, from
row 0's tensor of column ``c`` to row ``b``'s, which program row ``b`` adds to the pointer (``at_row``). Every
column's tensors have one dtype, shape and strides in all rows, so the kernel's strides and bounds hold for each.
Every row's tensor of a column starts at a multiple of ``ROW_ALIGNMENT`` bytes (allocations do; so do a batch
tensor's rows of whole cache rows), which ``row_table`` checks and ``at_row`` tells the compiler, so that the loads
of every row stay as vectorised as row 0's (Triton assumes 16-byte alignment of its pointer arguments but knows
nothing of a pointer moved by a distance read from memory). A column that cannot promise it (one element of a
``[B, 1]`` tensor per row, the step's positions) is named ``unaligned`` and read through ``at_row_unaligned``.

The columns of a kernel's table are its pointer arguments, in the order its ``*_ROW_COLUMNS`` names them; the caller
builds the table once for a batch's layer (the rows' buffers stay where they are from step to step, and the step's
own tensors, one batch tensor sliced by row, keep their rows' distances) and passes it at every step, so a captured
step replays with it. A kernel called without a table (``rows=None``) serves one row and reads no table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .triton_runtime import tl, triton

#: The byte alignment of every row's tensor of an aligned column.
ROW_ALIGNMENT = 16


@dataclass(frozen=True)
class RowTable:
    """``offsets [B, K]`` int64 on the kernels' device: element distances from row 0's tensor of each column (named
    by ``columns``, in the kernel's pointer order) to row ``b``'s."""

    offsets: torch.Tensor
    columns: tuple[str, ...]

    @property
    def n_rows(self) -> int:
        return self.offsets.shape[0]

    def check(self, columns: tuple[str, ...], kernel: str) -> None:
        """Refuse a table made for another kernel's columns."""
        if self.columns != columns:
            raise ValueError(f"{kernel}: a row table of columns {columns}, got {self.columns}")


def row_offsets(rows: Sequence[Mapping[str, torch.Tensor]], unaligned: tuple[str, ...] = ()) -> list[list[int]]:
    """Each row's element distances from row 0, column by column (the columns in the order of ``rows[0]``), after
    checking that a column's tensors agree in dtype, shape and strides, and that those of every column not named in
    ``unaligned`` start at multiples of ``ROW_ALIGNMENT`` bytes."""
    if not rows:
        raise ValueError("a row table needs at least one row")
    columns = tuple(rows[0])
    table = []
    for b, row in enumerate(rows):
        if tuple(row) != columns:
            raise ValueError(f"row {b} names the columns {tuple(row)}, row 0 {columns}")
        line = []
        for name in columns:
            first, tensor = rows[0][name], row[name]
            if (tensor.dtype, tensor.shape, tensor.stride(), tensor.device) != \
                    (first.dtype, first.shape, first.stride(), first.device):
                raise ValueError(f"column {name!r}: row {b}'s tensor ({tensor.dtype}, {tuple(tensor.shape)}, "
                                 f"strides {tensor.stride()}) is not laid out as row 0's ({first.dtype}, "
                                 f"{tuple(first.shape)}, strides {first.stride()})")
            distance, remainder = divmod(tensor.data_ptr() - first.data_ptr(), tensor.element_size())
            if remainder:
                raise ValueError(f"column {name!r}: row {b}'s tensor is not a whole number of elements from row 0's")
            if name not in unaligned and tensor.data_ptr() % ROW_ALIGNMENT:
                raise ValueError(f"column {name!r}: row {b}'s tensor does not start at a multiple of "
                                 f"{ROW_ALIGNMENT} bytes (name the column unaligned)")
            line.append(distance)
        table.append(line)
    return table


def row_table(rows: Sequence[Mapping[str, torch.Tensor]], unaligned: tuple[str, ...] = (),
              device: torch.device | None = None) -> RowTable:
    """The ``RowTable`` of ``rows`` (one mapping per row, column name to tensor, every row naming the same columns in
    the same order; ``unaligned``: the columns read through ``at_row_unaligned``), on ``device`` (default: row 0's
    first tensor's)."""
    offsets = row_offsets(rows, unaligned)
    if device is None:
        device = next(iter(rows[0].values())).device
    if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
        # Its copy to the device cannot be captured: the caller makes it in an eager step and keeps it.
        raise RuntimeError("a row table is made before the step that uses it is captured, in an eager step")
    return RowTable(torch.tensor(offsets, dtype=torch.int64).to(device), tuple(rows[0]))


@dataclass
class KeptRowTables:
    """The row tables a batch's layer made at one step, kept for the next: they stand while every row's buffers are
    those they were made for (``tokens``: an object per row that its layer replaces whenever it reallocates them; kept
    here, so that no later object takes its identity) and the step's own tensors keep their rows' distances
    (``step_key``: ``step_layout`` of them)."""

    tokens: tuple[object, ...]
    step_key: tuple
    tables: object

    def hold_for(self, tokens: tuple[object, ...], step_key: tuple) -> bool:
        return (self.step_key == step_key and len(self.tokens) == len(tokens)
                and all(kept is token for kept, token in zip(self.tokens, tokens)))


def step_layout(batch_tensors: Sequence[torch.Tensor], per_row: Sequence[torch.Tensor]) -> tuple:
    """What a step's own tensors' row distances follow from: the strides of its batch tensors (each row a slice of
    one) and the distances of ``per_row``'s tensors (one a row, e.g. the positions) from the first."""
    first = per_row[0].data_ptr() if per_row else 0
    return (tuple(t.stride() for t in batch_tensors), tuple(t.data_ptr() - first for t in per_row))


def table_arguments(rows: RowTable | None, fallback: torch.Tensor) -> tuple[torch.Tensor, int, int, bool]:
    """A kernel's ``(rows_ptr, n_rows, N_COLUMNS, BATCHED)``: the table's, or for one row without a table any tensor
    of the call (the kernel reads nothing from it)."""
    if rows is None:
        return fallback, 1, 1, False
    return rows.offsets, rows.n_rows, rows.offsets.shape[1], True


if triton is not None:

    @triton.jit
    def at_row(ptr, rows_ptr, row, COLUMN: tl.constexpr, N_COLUMNS: tl.constexpr, BATCHED: tl.constexpr):
        """``ptr`` moved to row ``row``'s tensor of column ``COLUMN`` (``ptr`` itself without a table), which starts
        at a multiple of ``ROW_ALIGNMENT`` (16) bytes."""
        if BATCHED:
            return tl.multiple_of(ptr + tl.load(rows_ptr + row * N_COLUMNS + COLUMN), 16)
        else:
            return ptr

    @triton.jit
    def at_row_unaligned(ptr, rows_ptr, row, COLUMN: tl.constexpr, N_COLUMNS: tl.constexpr, BATCHED: tl.constexpr):
        """``at_row`` for a column whose distances promise no alignment."""
        if BATCHED:
            return ptr + tl.load(rows_ptr + row * N_COLUMNS + COLUMN)
        else:
            return ptr
else:  # Triton absent: the names exist for the kernels' modules to import; nothing can call them
    at_row = at_row_unaligned = None
