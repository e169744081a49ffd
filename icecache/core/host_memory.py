"""The host memory of offloading methods: buffers kept from one sequence to the next, and the prompt's copy to them
beside the prefill.

Every method that keeps KV in host memory (ArkVale, ShadowKV, PQCache, OmniKV, MagicPIG, IceCache) does the same two
things at the end of a layer's prompt: it takes host buffers sized for the sequence, and it copies the layer's keys
and values into them. Done naively, both sit on the prompt's critical path: pinning fresh memory runs at about
2 GB/s (8 GB a sequence at 32k tokens of Llama-3.1-8B, four seconds, more than the prefill itself), and a copy on
the model's stream holds up the next layer's prefill. Here:

* ``HostPool`` hands out host buffers (pinned, device-mapped, on CUDA) and takes them back when the sequence ends,
  keeping them for the next sequence: a run allocates its host memory once. A request takes the smallest free buffer
  that holds it, if that buffer is at most ``REUSE_SLACK`` times the request (so that sequences of one length, and
  methods of like layouts, share the same memory); otherwise a new buffer of exactly the requested size. Free buffers
  beyond ``max_cached_bytes`` are released, largest first. One pool serves any number of methods whose sequences do
  not overlap (the latency engine shares one across the methods it interleaves); a method has its own by default.
* ``PromptCopies`` (one per sequence, ``SequenceContext.prompt_copies``) queues a device-to-host copy on a side
  stream after the model's stream has produced its source, so that layer ``l``'s copy runs while layer ``l + 1``'s
  prefill does. The model's stream waits for the copies (a device-side wait, no host synchronisation) before the
  first decode step (``join``, called by the generation loop and by the layers' decode); host code that reads a
  buffer first waits for the copy's event.

A buffer's contents are whatever the previous sequence left: a method reads a position only once it has written it,
or clears what it needs cleared (the same rule its ``torch.empty`` stores followed before).

On a CPU there is no pinning and no stream: buffers are plain tensors and copies run at once.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from dataclasses import dataclass, field

import torch

# A free buffer is reused for a request of at least 1 / REUSE_SLACK of its size.
REUSE_SLACK = 1.25


def to_device_without_waiting(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host ``tensor`` on ``device``, without making the calling thread wait for the device's queued work: on
    CUDA through pinned memory (a copy from pageable memory waits for the stream, which during a prefill leaves the
    GPU idle while the thread does a layer's host work); elsewhere ``tensor`` itself."""
    device = torch.device(device)
    if device.type == "cuda":
        tensor = tensor.contiguous().pin_memory()
    return tensor.to(device, non_blocking=True)


def tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes of a tensor of ``shape`` and ``dtype``."""
    nbytes = dtype.itemsize
    for extent in shape:
        nbytes *= int(extent)
    return nbytes


def host_available_bytes() -> int | None:
    """The host memory the kernel could still give this process without swapping (Linux ``MemAvailable``), or None
    where it is not known."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _pinned_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of pinned host memory, mapped into the device's address space, as a uint8 tensor that frees it when
    the last view goes. Exactly ``nbytes`` (PyTorch's pinned allocator rounds a request up to a power of two)."""
    from .cuda_driver import pinned_host_allocation

    address, free = pinned_host_allocation(nbytes, device)
    array = (ctypes.c_uint8 * nbytes).from_address(address)
    weakref.finalize(array, free)
    return torch.frombuffer(array, dtype=torch.uint8, count=nbytes)


@dataclass(eq=False)  # one buffer is equal only to itself (list.remove must not compare the tensors)
class _Buffer:
    data: torch.Tensor  # uint8, the whole allocation
    pinned: bool
    leased: bool = False

    @property
    def nbytes(self) -> int:
        return self.data.numel()


@dataclass
class HostPool:
    """Host buffers kept across sequences (see the module's docstring). Not thread-safe: layers take buffers from
    the thread that runs the model."""

    max_cached_bytes: int | None = None  # free buffers kept at most (None: every one)
    _buffers: list[_Buffer] = field(default_factory=list, repr=False)
    _leases: dict[int, tuple[torch.Tensor, _Buffer]] = field(default_factory=dict, repr=False)
    allocations: int = 0  # buffers made so far (a reused request makes none)
    allocated_total_bytes: int = 0  # their bytes (released ones included): what the pool has had to pin

    @property
    def allocated_bytes(self) -> int:
        """Bytes held now, leased or free."""
        return sum(b.nbytes for b in self._buffers)

    @property
    def leased_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers if b.leased)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A host tensor of ``shape`` and ``dtype`` (pinned and device-mapped where ``device`` is CUDA), leased until
        ``give_back`` of it; its contents are undefined."""
        device = torch.device(device)
        pinned = device.type == "cuda"
        nbytes = tensor_bytes(shape, dtype)
        wanted = max(nbytes, 1)
        fitting = self._fitting(wanted, pinned)
        if fitting:
            buffer = min(fitting, key=lambda b: b.nbytes)
        else:
            data = _pinned_bytes(wanted, device) if pinned else torch.empty(wanted, dtype=torch.uint8)
            buffer = _Buffer(data, pinned)
            self._buffers.append(buffer)
            self.allocations += 1
            self.allocated_total_bytes += wanted
        buffer.leased = True
        tensor = buffer.data[:nbytes].view(dtype).view(shape)
        self._leases[id(tensor)] = (tensor, buffer)
        return tensor

    def free_fitting(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> int:
        """How many free buffers a ``take`` of the same arguments could reuse."""
        return len(self._fitting(max(tensor_bytes(shape, dtype), 1), torch.device(device).type == "cuda"))

    def _fitting(self, wanted: int, pinned: bool) -> list[_Buffer]:
        """The free buffers that serve a request of ``wanted`` bytes (``REUSE_SLACK``)."""
        return [b for b in self._buffers if not b.leased and b.pinned == pinned
                and wanted <= b.nbytes <= REUSE_SLACK * wanted]

    def give_back(self, tensor: torch.Tensor) -> None:
        """End the lease of a tensor ``take`` returned (its buffer serves the next request that fits)."""
        lease = self._leases.get(id(tensor))
        if lease is None or lease[0] is not tensor:
            raise ValueError("give_back: the tensor is not a leased buffer of this pool")
        del self._leases[id(tensor)]
        lease[1].leased = False
        if self.max_cached_bytes is not None:
            self._release_free(self.max_cached_bytes)

    def clear(self) -> None:
        """Release every free buffer."""
        self._release_free(0)

    def _release_free(self, kept_bytes: int) -> None:
        """Release free buffers, largest first, until at most ``kept_bytes`` of them are left."""
        free = sorted((b for b in self._buffers if not b.leased), key=lambda b: -b.nbytes)
        cached = sum(b.nbytes for b in free)
        for buffer in free:
            if cached <= kept_bytes:
                break
            self._buffers.remove(buffer)
            cached -= buffer.nbytes


@dataclass
class PromptCopies:
    """One sequence's prompt copies to host memory and its leases of pool buffers (see the module's docstring)."""

    pool: HostPool = field(default_factory=HostPool)
    _leases: list[torch.Tensor] = field(default_factory=list, repr=False)
    _streams: dict[int, torch.cuda.Stream] = field(default_factory=dict, repr=False)
    _pending: set[int] = field(default_factory=set, repr=False)  # devices with copies the model's stream awaits
    # copy and join may be called from a worker of the sequence (ShadowKV queues its prompt's copy from the thread
    # that factorises it) while the model's thread joins.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        # A sequence dropped without ``close`` still gives its buffers back when it is collected.
        self._release = weakref.finalize(self, _release_leases, self.pool, self._leases, self._streams)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A pool buffer for this sequence (``HostPool.take``), given back when the sequence closes."""
        tensor = self.pool.take(shape, dtype, device)
        self._leases.append(tensor)
        return tensor

    def give_back(self, tensor: torch.Tensor) -> None:
        """End this sequence's lease of ``tensor`` before the sequence closes, once nothing reads it any more (its
        copy's event waited for): another sequence may take the buffer at once. Call from the thread that takes."""
        for index, leased in enumerate(self._leases):
            if leased is tensor:
                del self._leases[index]
                self.pool.give_back(tensor)
                return
        raise ValueError("give_back: the tensor is not a buffer this sequence leases")

    @property
    def leased_bytes(self) -> int:
        """Bytes of the pool buffers this sequence holds now."""
        return sum(tensor.nbytes for tensor in self._leases)

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> torch.cuda.Event | None:
        """Copy ``source`` (on the device) into the contiguous host tensor ``destination``: on CUDA, queued on the
        sequence's side stream after the model's stream has produced ``source``, returning the event a host reader
        waits for; on a CPU at once (None)."""
        if not destination.is_contiguous():
            raise ValueError("PromptCopies.copy needs a contiguous destination (copy row blocks one by one)")
        if not source.is_cuda:
            destination.copy_(source)
            return None
        index = source.device.index if source.device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(source.device)
            stream.wait_stream(torch.cuda.current_stream(source.device))
            with torch.cuda.stream(stream):
                destination.copy_(source, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            # The source's memory is reused by the model's stream only once the side stream is past it.
            source.record_stream(stream)
            self._pending.add(index)
        return done

    def join(self) -> None:
        """The current streams wait (on the device) for every copy queued so far: what a decode step needs before
        it reads the host buffers. Free when nothing is pending, so every decode step may call it."""
        with self._lock:
            for index in self._pending:
                torch.cuda.current_stream(index).wait_stream(self._streams[index])
            self._pending.clear()

    def close(self) -> None:
        """The sequence has ended: wait for its copies, then give its buffers back to the pool."""
        self._pending.clear()
        _release_leases(self.pool, self._leases, self._streams)


def _release_leases(pool: HostPool, leases: list[torch.Tensor], streams: dict[int, torch.cuda.Stream]) -> None:
    for stream in streams.values():
        stream.synchronize()
    for tensor in leases:
        pool.give_back(tensor)
    leases.clear()
