"""Paged KV storage of the shared core: the GPU page pool, and device views of pinned host memory.

Pages are per KV head. IceCache's pages are DCI leaves, and one leaf id holds different tokens in different heads,
so a pool is indexed ``[slot, kv_head]`` with a layer's keys and values each laid out
``[n, n_kv_heads, page_size, head_dim]``. The kernels that move pages into a pool are ``kernels.page_scatter`` and
``kernels.block_copy``.

On a machine without CUDA the pool holds plain CPU tensors, so every method runs (slowly) on CPU.
"""

from __future__ import annotations

import torch


class GpuPagePool:
    """A layer's page slots on the model's device, sized by the budget, not by the context.

    ``key_pages`` and ``value_pages`` are ``[n_slots, n_kv_heads, page_size, head_dim]``; slot ``s`` of head ``h``
    holds whichever page the method put there. New slots are zero, so unused slots are finite.
    """

    def __init__(
        self,
        n_slots: int,
        n_kv_heads: int,
        page_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (n_slots, n_kv_heads, page_size, head_dim)
        self.key_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.value_pages = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def n_slots(self) -> int:
        return self.key_pages.shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.key_pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.key_pages.shape[2]

    @property
    def head_dim(self) -> int:
        return self.key_pages.shape[3]

    @property
    def device(self) -> torch.device:
        return self.key_pages.device

    def nbytes(self) -> int:
        """Device bytes held by the pool's keys and values."""
        return self.key_pages.nbytes + self.value_pages.nbytes


class _ArrayInterface:
    """What ``torch.as_tensor`` needs to wrap a device address (``__cuda_array_interface__``, version 3)."""

    def __init__(self, address: int, shape: tuple[int, ...], typestr: str):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (address, False), "version": 3}


def mapped_device_view(pinned: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over the same bytes as the contiguous pinned host tensor ``pinned``, which kernels read and
    write directly across PCIe (zero-copy). With unified addressing, page-locked memory from ``cudaHostAlloc`` (what
    ``pin_memory`` uses) is mapped into every device at its host address, so no copy or driver call is needed. The
    view does not keep ``pinned`` alive: its owner must. A kernel that reads it can be captured in a CUDA graph,
    which a ``cudaMemcpy`` from device-chosen addresses cannot."""
    if not (pinned.is_pinned() and pinned.is_contiguous()):
        raise ValueError("mapped_device_view needs a contiguous pinned tensor")
    as_words = pinned.view(torch.int16) if pinned.element_size() == 2 else pinned
    typestr = {torch.int16: "<i2", torch.float32: "<f4"}.get(as_words.dtype)
    if typestr is None:
        raise ValueError(f"mapped_device_view: unsupported dtype {pinned.dtype}")
    with torch.cuda.device(device):
        view = torch.as_tensor(_ArrayInterface(as_words.data_ptr(), tuple(as_words.shape), typestr), device=device)
    return view.view(pinned.dtype)
