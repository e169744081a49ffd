"""The block copy: ``target[slots[i], heads[i]] = source[pages[i], heads[i]]`` for keys and values laid out
``[n, Hkv, page_size, D]``, cast to the target's dtype, every entry with a negative slot skipped.

ArkVale, ShadowKV and PQCache recall pages with it from a pinned host store read in place through
``paged.mapped_device_view`` (zero-copy), where a skipped entry saves a PCIe read.

* ``copy_blocks_reference``: fixed-shape index operations, so that it can be captured: a skipped entry reads page 0
  and writes the target's last slot, which the caller keeps as a scratch slot.
* ``copy_blocks_triton``: one program per entry, each moving one contiguous ``page_size * head_dim`` block of keys
  and one of values; a skipped entry's loads and stores are fully masked, so it moves no byte. With ``programs=P``
  instead, P programs take the entries in turn (entry ``i`` to program ``i % P``), each moving a block
  ``chunk_elements`` at a time and skipping a negative slot's entry with a branch: a copy that runs beside other
  kernels (PQCache's block-cache update, on a side stream) then holds P programs' registers, not one program per
  entry on every SM, with P chunks of each array in flight across PCIe (the link probe's ``random_32_programs``
  times the rate it reaches).
* ``copy_blocks``: the dispatch, the Triton kernel for a CUDA target when ``triton_runtime.available()``, the
  reference otherwise. It has no launch state: every call goes through Triton's launch path.

With a ``RowTable`` (``rows``, columns ``COPY_ROW_COLUMNS``) one launch copies for every row of a batch, each row with
its own source, target and copy list, the tensors given being row 0's (``row_table``).
"""

from __future__ import annotations

import torch

from .row_table import RowTable, at_row, table_arguments
from .triton_runtime import available as triton_available
from .triton_runtime import require_triton, tl, triton

#: The tensors ``copy_blocks`` finds per row of a batch, in the kernel's pointer order.
COPY_ROW_COLUMNS = ("source_keys", "source_values", "target_keys", "target_values", "pages", "slots", "heads")


def copy_blocks_reference(
    source_keys: torch.Tensor, source_values: torch.Tensor, pages: torch.Tensor,
    target_keys: torch.Tensor, target_values: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor,
) -> None:
    """``target[slots[i], heads[i]] = source[pages[i], heads[i]]`` for keys and values ``[n, Hkv, page_size, D]``,
    skipping entries whose slot is negative. Fixed shapes (no data-dependent indexing), so it can be captured:
    skipped entries read page 0 and write the target's last slot, which the caller keeps as a scratch slot."""
    use = slots >= 0
    rows = torch.where(use, pages, 0)
    targets = torch.where(use, slots, target_keys.shape[0] - 1)
    target_keys.index_put_((targets, heads), source_keys[rows, heads].to(target_keys.dtype))
    target_values.index_put_((targets, heads), source_values[rows, heads].to(target_values.dtype))


if triton is not None:

    @triton.jit
    def _at_row_columns(source_keys_ptr, source_values_ptr, target_keys_ptr, target_values_ptr, pages_ptr, slots_ptr,
                        heads_ptr, rows_ptr, row, N_COLUMNS: tl.constexpr, BATCHED: tl.constexpr):
        """Each of the copy's pointers moved to row ``row``'s tensor (``COPY_ROW_COLUMNS`` order)."""
        return (at_row(source_keys_ptr, rows_ptr, row, 0, N_COLUMNS, BATCHED),
                at_row(source_values_ptr, rows_ptr, row, 1, N_COLUMNS, BATCHED),
                at_row(target_keys_ptr, rows_ptr, row, 2, N_COLUMNS, BATCHED),
                at_row(target_values_ptr, rows_ptr, row, 3, N_COLUMNS, BATCHED),
                at_row(pages_ptr, rows_ptr, row, 4, N_COLUMNS, BATCHED),
                at_row(slots_ptr, rows_ptr, row, 5, N_COLUMNS, BATCHED),
                at_row(heads_ptr, rows_ptr, row, 6, N_COLUMNS, BATCHED))

    @triton.jit
    def _copy_blocks_kernel(
        source_keys_ptr, source_values_ptr, target_keys_ptr, target_values_ptr, pages_ptr, slots_ptr, heads_ptr,
        rows_ptr, n_entries, stride_source_page, stride_source_head, stride_target_slot, stride_target_head,
        BLOCK_SIZE: tl.constexpr, BLOCK_ELEMENTS: tl.constexpr, N_COLUMNS: tl.constexpr, BATCHED: tl.constexpr,
        ENTRIES: tl.constexpr,
    ):
        block = tl.program_id(0)
        row = tl.program_id(2)  # COPY_ROW_COLUMNS
        source_keys_ptr, source_values_ptr, target_keys_ptr, target_values_ptr, pages_ptr, slots_ptr, heads_ptr = \
            _at_row_columns(source_keys_ptr, source_values_ptr, target_keys_ptr, target_values_ptr, pages_ptr,
                            slots_ptr, heads_ptr, rows_ptr, row, N_COLUMNS, BATCHED)
        elements = tl.arange(0, BLOCK_ELEMENTS)
        if ENTRIES == 1:
            slot = tl.load(slots_ptr + block).to(tl.int64)
            page = tl.load(pages_ptr + block).to(tl.int64)
            head = tl.load(heads_ptr + block).to(tl.int64)
            ok = elements < tl.where(slot >= 0, BLOCK_SIZE, 0)  # a negative slot: nothing read, nothing written
            source = page * stride_source_page + head * stride_source_head + elements
            target = slot * stride_target_slot + head * stride_target_head + elements
        else:  # ENTRIES entries a program: more bytes in flight for each, which reads across PCIe want
            entries = block * ENTRIES + tl.arange(0, ENTRIES)
            listed = entries < n_entries
            slot = tl.load(slots_ptr + entries, mask=listed, other=-1).to(tl.int64)
            page = tl.load(pages_ptr + entries, mask=listed, other=0).to(tl.int64)
            head = tl.load(heads_ptr + entries, mask=listed, other=0).to(tl.int64)
            ok = (slot >= 0)[:, None] & (elements < BLOCK_SIZE)[None, :]
            source = (page * stride_source_page + head * stride_source_head)[:, None] + elements[None, :]
            target = (slot * stride_target_slot + head * stride_target_head)[:, None] + elements[None, :]
        keys = tl.load(source_keys_ptr + source, mask=ok)
        values = tl.load(source_values_ptr + source, mask=ok)
        tl.store(target_keys_ptr + target, keys.to(target_keys_ptr.dtype.element_ty), mask=ok)
        tl.store(target_values_ptr + target, values.to(target_values_ptr.dtype.element_ty), mask=ok)


    @triton.jit
    def _copy_blocks_strided_kernel(
        source_keys_ptr, source_values_ptr, target_keys_ptr, target_values_ptr, pages_ptr, slots_ptr, heads_ptr,
        rows_ptr, n_entries, n_programs, n_turns, stride_source_page, stride_source_head, stride_target_slot,
        stride_target_head, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr, N_COLUMNS: tl.constexpr,
        BATCHED: tl.constexpr,
    ):
        program = tl.program_id(0)
        row = tl.program_id(2)  # COPY_ROW_COLUMNS
        source_keys_ptr, source_values_ptr, target_keys_ptr, target_values_ptr, pages_ptr, slots_ptr, heads_ptr = \
            _at_row_columns(source_keys_ptr, source_values_ptr, target_keys_ptr, target_values_ptr, pages_ptr,
                            slots_ptr, heads_ptr, rows_ptr, row, N_COLUMNS, BATCHED)
        elements = tl.arange(0, CHUNK)
        for turn in range(0, n_turns):  # the program's entries: program, program + n_programs, ...
            entry = program + turn * n_programs
            slot = tl.load(slots_ptr + entry, mask=entry < n_entries, other=-1).to(tl.int64)
            if slot >= 0:  # a negative slot, or past the list: nothing read, nothing written
                page = tl.load(pages_ptr + entry).to(tl.int64)
                head = tl.load(heads_ptr + entry).to(tl.int64)
                source = page * stride_source_page + head * stride_source_head
                target = slot * stride_target_slot + head * stride_target_head
                for start in range(0, BLOCK_SIZE, CHUNK):
                    offsets = start + elements
                    ok = offsets < BLOCK_SIZE
                    keys = tl.load(source_keys_ptr + source + offsets, mask=ok)
                    values = tl.load(source_values_ptr + source + offsets, mask=ok)
                    tl.store(target_keys_ptr + target + offsets, keys.to(target_keys_ptr.dtype.element_ty), mask=ok)
                    tl.store(target_values_ptr + target + offsets, values.to(target_values_ptr.dtype.element_ty),
                             mask=ok)


#: ``copy_blocks_triton(programs=...)``: elements of a block each program moves at a time (two arrays of 16-bit
#: values: 16 KB in flight a program).
DEFAULT_CHUNK_ELEMENTS = 4096


def copy_blocks_triton(
    source_keys: torch.Tensor, source_values: torch.Tensor, pages: torch.Tensor,
    target_keys: torch.Tensor, target_values: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor,
    rows: RowTable | None = None, entries_per_program: int = 1, programs: int | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> None:
    """The Triton kernel of ``copy_blocks_reference`` (each block contiguous, keys and values of one layout), entries
    with a negative slot skipped without a read; with ``rows``, for every row of a batch; ``entries_per_program``
    (a power of two) entries a program; or, with ``programs``, that many programs (at most one per entry) taking the
    entries in turn, ``chunk_elements`` (a power of two) of a block at a time."""
    require_triton()
    if rows is not None:
        rows.check(COPY_ROW_COLUMNS, "copy_blocks")
    if entries_per_program < 1 or entries_per_program & (entries_per_program - 1):
        raise ValueError(f"entries_per_program must be a power of two, not {entries_per_program}")
    if programs is not None and (programs < 1 or entries_per_program != 1):
        raise ValueError(f"programs={programs} must be at least 1, with entries_per_program left at 1")
    if chunk_elements < 1 or chunk_elements & (chunk_elements - 1):
        raise ValueError(f"chunk_elements must be a power of two, not {chunk_elements}")
    n = slots.numel()
    if n == 0:
        return
    page_size, head_dim = target_keys.shape[-2:]
    for name, tensor in (("source_keys", source_keys), ("source_values", source_values),
                         ("target_keys", target_keys), ("target_values", target_values)):
        if tensor.stride(-1) != 1 or tensor.stride(-2) != head_dim:
            raise ValueError(f"{name} must be contiguous within each page block")
    if source_keys.stride()[:2] != source_values.stride()[:2] or target_keys.stride()[:2] != target_values.stride()[:2]:
        raise ValueError("keys and values must have the same layout")
    block_size = page_size * head_dim
    rows_ptr, n_rows, n_columns, batched = table_arguments(rows, slots)
    if programs is not None:
        programs = min(programs, n)
        _copy_blocks_strided_kernel[(programs, 1, n_rows)](
            source_keys, source_values, target_keys, target_values, pages, slots, heads, rows_ptr, n, programs,
            triton.cdiv(n, programs), source_keys.stride(0), source_keys.stride(1), target_keys.stride(0),
            target_keys.stride(1),
            BLOCK_SIZE=block_size, CHUNK=min(chunk_elements, triton.next_power_of_2(block_size)),
            N_COLUMNS=n_columns, BATCHED=batched, num_warps=4,
        )
        return
    _copy_blocks_kernel[(triton.cdiv(n, entries_per_program), 1, n_rows)](
        source_keys, source_values, target_keys, target_values, pages, slots, heads, rows_ptr, n,
        source_keys.stride(0), source_keys.stride(1), target_keys.stride(0), target_keys.stride(1),
        BLOCK_SIZE=block_size, BLOCK_ELEMENTS=triton.next_power_of_2(block_size), N_COLUMNS=n_columns,
        BATCHED=batched, ENTRIES=entries_per_program, num_warps=4,
    )


def copy_blocks(
    source_keys: torch.Tensor, source_values: torch.Tensor, pages: torch.Tensor,
    target_keys: torch.Tensor, target_values: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor,
    programs: int | None = None,
) -> None:
    """Dispatch: on CUDA with Triton one kernel whose skipped entries move no byte (the source may be mapped host
    memory, ``paged.mapped_device_view``, so a skipped entry saves a PCIe read), with ``programs`` programs taking
    the entries in turn if given (``copy_blocks_triton``); otherwise the reference, which ``programs`` does not
    change."""
    if target_keys.is_cuda and triton_available():
        copy_blocks_triton(source_keys, source_values, pages, target_keys, target_values, slots, heads,
                           programs=programs)
    else:
        copy_blocks_reference(source_keys, source_values, pages, target_keys, target_values, slots, heads)
