"""An IceCache layer's fixed decode-step buffers: its exchange with the host (``core.host_step.HostExchange``)
seen as typed host arrays, and the attention's page table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from icecache.core.cuda_driver import HostFunctions
from icecache.core.host_step import HostExchange


@dataclass
class DecodeBuffers:
    """Made once, at a layer's first decode step (prefill allocates no pinned memory), so that a step's host work
    builds no tensor and every step makes the same copies, which a CUDA graph can record.

    To the host (float32): the step's ``query [Hq, D]`` and the new token's ``key`` and ``value [Hkv, D]``. To the
    device (one byte buffer, one copy): the flat pool rows the new token is written to (``window_rows``), the
    valid-token count of every slot (``counts``), and up to ``max_blocks`` page blocks (``keys``, ``values``, as
    bytes on the host) with their slot and head (slot -1: an unused entry, which the scatter skips); with a trace
    width the sequence fixes, the step's trace (``attended``, one byte per KV head and position). A step sends
    all ``max_blocks`` whether it loads them or not: at 8 KV heads and 12 selected pages of 16 bf16 tokens that is
    0.8 MB, ~16 us of PCIe per layer, the price of a copy whose size the host need not decide before the step.

    The page table is slot ``i`` -> page ``i`` for good: an empty slot needs no -1 entry, as a count of 0 already
    masks all its positions (in the Triton kernel and in the PyTorch reference alike); only the counts change.
    """

    exchange: HostExchange
    slot_table: torch.Tensor  # [Hkv, n_slots] on the device
    query: np.ndarray  # float32 [Hq, D], searched in place
    key: torch.Tensor  # float32 [Hkv, D]
    value: torch.Tensor
    window_rows: np.ndarray  # int64 [Hkv]
    counts: np.ndarray  # int32 [Hkv, n_slots]
    slots: np.ndarray  # int32 [max_blocks]
    heads: np.ndarray  # int32 [max_blocks]
    keys: np.ndarray  # uint8 [max_blocks, page_bytes]
    values: np.ndarray
    attended: np.ndarray | None  # uint8 [Hkv, trace width], only with a fixed trace width

    @classmethod
    def make(cls, n_heads: int, n_kv_heads: int, n_slots: int, max_blocks: int, page_size: int, head_dim: int,
             block_dtype: torch.dtype, device: torch.device, host_functions: HostFunctions,
             trace_width: int = 0) -> DecodeBuffers:
        f32, i32 = torch.float32, torch.int32
        block = ((max_blocks, page_size, head_dim), block_dtype)
        trace = {"attended": ((n_kv_heads, trace_width), torch.uint8)} if trace_width else {}
        exchange = HostExchange(
            to_host={"query": ((n_heads, head_dim), f32), "key": ((n_kv_heads, head_dim), f32),
                     "value": ((n_kv_heads, head_dim), f32)},
            to_device={"window_rows": ((n_kv_heads,), torch.int64), "counts": ((n_kv_heads, n_slots), i32),
                       "slots": ((max_blocks,), i32), "heads": ((max_blocks,), i32), "keys": block, "values": block,
                       **trace},
            device=device, host_functions=host_functions,
        )
        host_in, host_out = exchange.host_in, exchange.host_out

        def as_bytes(blocks: torch.Tensor) -> np.ndarray:  # numpy has no bfloat16
            return blocks.view(torch.uint8).view(max_blocks, -1).numpy()

        buffers = cls(
            exchange, torch.arange(n_slots, device=device).expand(n_kv_heads, n_slots), host_in["query"].numpy(),
            host_in["key"], host_in["value"], host_out["window_rows"].numpy(), host_out["counts"].numpy(),
            host_out["slots"].numpy(), host_out["heads"].numpy(), as_bytes(host_out["keys"]),
            as_bytes(host_out["values"]), host_out["attended"].numpy() if trace_width else None,
        )
        buffers.slots.fill(-1)  # nothing to load until the host step says so
        return buffers

    def point(self, native) -> None:
        """Give the layer's C++ decode step (``_dci.DecodeStep``) the addresses of every host buffer it reads and
        writes: the buffers live as long as the layer, which holds both."""
        def address(array: np.ndarray | None) -> int:
            return 0 if array is None else array.ctypes.data

        native.set_buffers(
            address(self.query), self.key.data_ptr(), self.value.data_ptr(), address(self.window_rows),
            address(self.counts), self.counts.shape[1], address(self.slots), address(self.heads), self.slots.shape[0],
            address(self.keys), address(self.values), address(self.attended),
            0 if self.attended is None else self.attended.shape[1],
        )
