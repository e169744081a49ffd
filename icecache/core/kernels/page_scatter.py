"""The page scatter: ``n`` transit blocks ``[page_size, head_dim]`` written into ``pool[slot, head]``.

IceCache's decode step receives the page blocks it loads in one fixed-size transit buffer from the host and
scatters them into their pool slots with one launch; entries with a negative slot are the unused part of that
fixed-size transfer and are skipped.

* ``scatter_pages_reference``: PyTorch index operations.
* ``scatter_pages_triton``: one program per block, each moving one contiguous ``page_size * head_dim`` run of keys
  and one of values, cast to the pool dtype; after the first call of a layout the compiled kernel is launched
  directly (``PageScatterPlan``, which the calling layer keeps).
* ``scatter_pages``: the dispatch, the Triton kernel for a CUDA pool when ``triton_runtime.available()``, the
  reference otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cuda_driver import stream_handle
from .triton_runtime import DirectLaunch, aligned, require_triton, tl, triton
from .triton_runtime import available as triton_available


def scatter_pages_reference(
    transit_keys: torch.Tensor,
    transit_values: torch.Tensor,
    pool_keys: torch.Tensor,
    pool_values: torch.Tensor,
    slots: torch.Tensor,
    heads: torch.Tensor,
) -> None:
    """Write block ``i`` of ``transit_keys``/``transit_values [n, S, D]`` into ``pool[slots[i], heads[i]]``
    (values cast to the pool dtype; ``(slots[i], heads[i])`` pairs must be distinct; entries with a negative slot
    are padding and skipped)."""
    used = slots >= 0
    if not bool(used.all()):
        transit_keys = transit_keys[used.to(transit_keys.device)]
        transit_values = transit_values[used.to(transit_values.device)]
        slots, heads = slots[used], heads[used.to(heads.device)]
    index = (slots.to(pool_keys.device, torch.long), heads.to(pool_keys.device, torch.long))
    pool_keys.index_put_(index, transit_keys.to(pool_keys.device, pool_keys.dtype))
    pool_values.index_put_(index, transit_values.to(pool_values.device, pool_values.dtype))


if triton is not None:

    @triton.jit
    def _scatter_pages_kernel(
        transit_keys_ptr, transit_values_ptr, pool_keys_ptr, pool_values_ptr, slots_ptr, heads_ptr,
        stride_tn, stride_pool_slot, stride_pool_head,
        BLOCK_SIZE: tl.constexpr, BLOCK_ELEMENTS: tl.constexpr,
    ):
        block = tl.program_id(0)
        slot = tl.load(slots_ptr + block).to(tl.int64)
        head = tl.load(heads_ptr + block).to(tl.int64)
        elements = tl.arange(0, BLOCK_ELEMENTS)
        # A negative slot is an unused entry of a fixed-size transfer: no element of it is moved.
        ok = elements < tl.where(slot >= 0, BLOCK_SIZE, 0)
        source = block.to(tl.int64) * stride_tn + elements
        target = slot * stride_pool_slot + head * stride_pool_head + elements
        keys = tl.load(transit_keys_ptr + source, mask=ok)
        values = tl.load(transit_values_ptr + source, mask=ok)
        tl.store(pool_keys_ptr + target, keys.to(pool_keys_ptr.dtype.element_ty), mask=ok)
        tl.store(pool_values_ptr + target, values.to(pool_values_ptr.dtype.element_ty), mask=ok)


@dataclass(eq=False)
class PageScatterPlan:
    """The launch state of one caller's page scatter: the compiled kernel of each layout it has launched.
    ``direct_launch`` as in ``paged_decode_attention.PagedAttentionPlan``."""

    direct_launch: bool | None = None
    _launch: DirectLaunch = field(init=False, repr=False)
    _compiled: dict[tuple, object] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self):
        self._launch = DirectLaunch(self.direct_launch)


def scatter_pages_triton(
    transit_keys: torch.Tensor,
    transit_values: torch.Tensor,
    pool_keys: torch.Tensor,
    pool_values: torch.Tensor,
    slots: torch.Tensor,
    heads: torch.Tensor,
    plan: PageScatterPlan,
) -> None:
    """Write block ``i`` of ``transit_keys``/``transit_values [n, S, D]`` into ``pool[slots[i], heads[i]]``.

    The pools are ``[n_slots, Hkv, S, D]`` and must be contiguous in their last two dimensions (one page block is
    one run of ``S * D`` elements); the transit blocks likewise. Values are cast to the pool dtype.
    ``(slots[i], heads[i])`` pairs must be distinct, as for ``index_put_``; entries with a negative slot are skipped
    (the padding of a fixed-size transfer).
    """
    require_triton()
    n = transit_keys.shape[0]
    if n == 0:
        return
    page_size, head_dim = pool_keys.shape[-2:]
    block_size = page_size * head_dim
    for name, tensor in (("transit_keys", transit_keys), ("transit_values", transit_values),
                         ("pool_keys", pool_keys), ("pool_values", pool_values)):
        if tensor.stride(-1) != 1 or tensor.stride(-2) != head_dim:
            raise ValueError(f"{name} must be contiguous within each page block")
    if transit_keys.stride(0) != transit_values.stride(0) or pool_keys.stride()[:2] != pool_values.stride()[:2]:
        raise ValueError("keys and values must have the same layout")
    device = pool_keys.device
    if slots.device != device:
        slots = slots.to(device=device, non_blocking=True)
    if heads.device != device:
        heads = heads.to(device=device, non_blocking=True)
    args = (
        transit_keys, transit_values, pool_keys, pool_values, slots, heads,
        transit_keys.stride(0), pool_keys.stride(0), pool_keys.stride(1),
        block_size, triton.next_power_of_2(block_size),
    )
    stream = stream_handle(device)
    is_aligned = aligned(transit_keys, transit_values, pool_keys, pool_values, slots, heads)
    key = (device, is_aligned, transit_keys.dtype, transit_values.dtype, pool_keys.dtype, pool_values.dtype,
           slots.dtype, heads.dtype, *args[6:])
    compiled = plan._launch(_scatter_pages_kernel, plan._compiled.get(key), (n,), args, stream, {"num_warps": 4})
    if is_aligned and compiled is not None:
        plan._compiled[key] = compiled


def scatter_pages(
    transit_keys: torch.Tensor,
    transit_values: torch.Tensor,
    pool_keys: torch.Tensor,
    pool_values: torch.Tensor,
    slots: torch.Tensor,
    heads: torch.Tensor,
    plan: PageScatterPlan,
) -> None:
    """Dispatch: the Triton scatter (launched through ``plan``) on CUDA when available, the reference otherwise."""
    if pool_keys.is_cuda and triton_available():
        scatter_pages_triton(transit_keys, transit_values, pool_keys, pool_values, slots, heads, plan)
        return
    scatter_pages_reference(transit_keys, transit_values, pool_keys, pool_values, slots, heads)
