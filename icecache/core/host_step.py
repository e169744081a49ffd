"""The one way a method does host work in the middle of a decode step that may be captured in a CUDA graph.

A layer whose step needs the CPU (IceCache's index search and page gather, MagicPIG's sampled attention over keys
in host memory) declares once, by name, shape and dtype, what its host work reads (``to_host``) and what it answers
(``to_device``), and makes a ``HostExchange``. Every step then does the same three things:

1. ``send(name=tensor, ...)``: the device tensors into one staging buffer, one device-to-host copy of it;
2. ``run(work)``: ``work()`` on the host once those inputs have arrived; it reads ``host_in`` and writes
   ``host_out`` (CPU tensors, pinned on CUDA) and must not call CUDA;
3. ``receive()``: one host-to-device copy of ``host_out``; the returned device views are what the rest of the step
   reads.

Every copy has the same size and address at every step, so a CUDA graph can record them. Captured, the work becomes
a host function of the graph (``cuda_driver.HostFunctions``), which the driver runs at every replay once the stream
reaches it, and the copies are the driver's raw copies (``copy_async``); eagerly the step waits for its inputs (one
synchronisation) and runs the same function, so a replay computes bitwise what the eager step computes. On a CPU
the "device" tensors are the host buffers themselves and nothing is copied.
"""

from __future__ import annotations

from typing import Callable

import torch

from .cuda_driver import HostFunctions, call_native, launch_host_function, memcpy_async

# Each section starts aligned, so typed views of the one byte buffer are valid and the kernels that read a section
# of it get vector-aligned rows.
_ALIGN_BYTES = 128

Sections = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _layout(sections: Sections) -> tuple[dict[str, tuple[int, int]], int]:
    offsets, cursor = {}, 0
    for name, (shape, dtype) in sections.items():
        cursor = -(-cursor // _ALIGN_BYTES) * _ALIGN_BYTES
        size = dtype.itemsize
        for extent in shape:
            size *= extent
        offsets[name] = (cursor, cursor + size)
        cursor += size
    return offsets, max(cursor, 1)


def _views(buffer: torch.Tensor, sections: Sections, offsets: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    return {name: buffer[offsets[name][0] : offsets[name][1]].view(dtype).view(shape)
            for name, (shape, dtype) in sections.items()}


def copy_async(destination: torch.Tensor, source: torch.Tensor) -> None:
    """A non-blocking copy between pinned host and device memory on the current stream: PyTorch's eagerly, the
    driver's raw copy while a CUDA graph is being captured (``cuda_driver.memcpy_async``)."""
    if torch.cuda.is_current_stream_capturing():
        memcpy_async(destination, source)
    else:
        destination.copy_(source, non_blocking=True)


class HostExchange:
    """Named fixed-shape tensors to the host (``to_host``) and back (``to_device``), each direction one buffer.

    ``host_in`` and ``host_out`` are the host views by name (what the host work reads and writes); ``device_out``
    the device views ``receive`` returns. ``host_functions`` is the sequence's (``SequenceContext.host_functions``),
    which keeps captured host functions alive as long as a graph may replay them.
    """

    def __init__(self, to_host: Sections, to_device: Sections, device: torch.device | str,
                 host_functions: HostFunctions) -> None:
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.host_functions = host_functions
        in_offsets, in_bytes = _layout(to_host)
        out_offsets, out_bytes = _layout(to_device)
        pin = self.on_cuda
        self._in_host = torch.zeros(in_bytes, dtype=torch.uint8, pin_memory=pin)
        self._out_host = torch.zeros(out_bytes, dtype=torch.uint8, pin_memory=pin)
        self._in_device = torch.zeros(in_bytes, dtype=torch.uint8, device=self.device) if pin else self._in_host
        self._out_device = torch.zeros(out_bytes, dtype=torch.uint8, device=self.device) if pin else self._out_host
        self.host_in = _views(self._in_host, to_host, in_offsets)
        self.host_out = _views(self._out_host, to_device, out_offsets)
        self._staged = _views(self._in_device, to_host, in_offsets)
        self.device_out = _views(self._out_device, to_device, out_offsets)
        self._arrived = torch.cuda.Event() if self.on_cuda else None

    def send(self, **tensors: torch.Tensor) -> None:
        """Stage every section of ``to_host`` (each given once, cast to its dtype) and copy them to the host
        (asynchronously on CUDA: ``run`` is where the host may read them)."""
        for name, view in self._staged.items():
            view.copy_(tensors[name].reshape(view.shape))
        if self.on_cuda:
            copy_async(self._in_host, self._in_device)

    def run(self, work: Callable[[], None]) -> None:
        """``work()`` once the staged inputs are on the host: now (CPU), after waiting for them (eager CUDA), or as
        a host function of the stream being captured."""
        if not self.on_cuda:
            work()
        elif torch.cuda.is_current_stream_capturing():
            self.host_functions.launch(work, self.device)
        else:
            self._arrived.record()
            self._arrived.synchronize()
            work()

    def run_native(self, function_address: int, state_address: int) -> None:
        """``run`` for host work written in C/C++: the C function ``void f(void* state)`` at ``function_address``
        called with ``state_address``, with no Python on the way (ctypes releases the GIL; a captured step enqueues
        the raw function pointer, so a replay runs no Python at all). The function must not throw: it keeps its
        own error for the caller to raise after the step."""
        if not self.on_cuda:
            call_native(function_address, state_address)
        elif torch.cuda.is_current_stream_capturing():
            launch_host_function(function_address, state_address, self.device)
        else:
            self._arrived.record()
            self._arrived.synchronize()
            call_native(function_address, state_address)

    def receive(self) -> dict[str, torch.Tensor]:
        """Copy ``host_out`` to the device (asynchronously on CUDA) and return the device views."""
        if self.on_cuda:
            copy_async(self._out_device, self._out_host)
        return self.device_out

    def nbytes(self) -> tuple[int, int]:
        """(pinned host bytes, device bytes) held."""
        host = self._in_host.nbytes + self._out_host.nbytes
        return host, (host if self.on_cuda else 0)
