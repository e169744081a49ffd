"""Host work in the middle of a decode step that may be captured in a CUDA graph: fixed buffers to the host and
back, and the host work run where the step can wait for it.

A layer whose step needs the CPU (MagicPIG's sampled attention over keys in host memory) stages named device
tensors into one pinned buffer (one device-to-host copy), runs its host function on what arrived, and sends the
host's results back in one host-to-device copy into device tensors that the rest of the step reads. Every copy has
the same size and address at every step, so a CUDA graph can record them: captured, the host work becomes a host
function of the graph (``cuda_driver.HostFunctions``), which the driver runs at every replay once the stream
reaches it; eagerly the step waits for its inputs (one synchronisation) and runs the same function; on a CPU
the "device" tensors are the host buffers themselves and nothing is copied. The host function must not call CUDA.
"""

from __future__ import annotations

from typing import Callable

import torch

from .cuda_driver import memcpy_async

_ALIGN_BYTES = 128  # each section starts aligned, so typed views of the one byte buffer are valid and fast


def _layout(sections: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[dict[str, tuple[int, int]], int]:
    offsets, cursor = {}, 0
    for name, (shape, dtype) in sections.items():
        cursor = -(-cursor // _ALIGN_BYTES) * _ALIGN_BYTES
        size = dtype.itemsize
        for extent in shape:
            size *= extent
        offsets[name] = (cursor, cursor + size)
        cursor += size
    return offsets, max(cursor, 1)


def _views(buffer: torch.Tensor, sections, offsets) -> dict[str, torch.Tensor]:
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

    ``send(name=tensor, ...)`` writes device tensors into the device staging buffer and copies it to the host;
    ``run(work)`` runs ``work()`` once the inputs are on the host; ``receive()`` copies what ``work`` wrote into
    ``host_out`` to the device and returns the device views. ``host_in`` and ``host_out`` are CPU tensors (pinned
    on CUDA) that the host function reads and writes.
    """

    def __init__(self, to_host: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 to_device: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device | str,
                 host_functions) -> None:
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
        """Stage every section of ``to_host`` (each given once, cast to its dtype) and copy them to the host."""
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

    def receive(self) -> dict[str, torch.Tensor]:
        """Copy ``host_out`` to the device (asynchronously on CUDA) and return the device views."""
        if self.on_cuda:
            copy_async(self._out_device, self._out_host)
        return self.device_out

    def nbytes(self) -> tuple[int, int]:
        """(pinned host bytes, device bytes) held."""
        host = self._in_host.nbytes + self._out_host.nbytes
        return host, (host if self.on_cuda else 0)
