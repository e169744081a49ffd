"""Paged KV storage of the shared core: the GPU page pool, the CPU page store and the bulk CPU -> GPU loader.

Pages are per KV head. IceCache's pages are DCI leaves, and one leaf id holds different tokens in different heads,
so both stores are indexed ``[page_or_slot, kv_head]`` with a layer's keys and values each laid out
``[n, n_kv_heads, page_size, head_dim]``.

The bulk loader is IceCache's load path (docs/algorithms.md, IceCache, decode step 6): gather the requested (page, head)
blocks from the CPU store into one contiguous pinned transit buffer, send it to the GPU with one non-blocking copy
on a side stream, and scatter each block into its pool slot with one kernel. One large copy instead of one per
page is what makes the transfer run near PCIe bandwidth rather than at per-copy latency.

On a machine without CUDA the same classes hold plain CPU tensors and the loader uses index operations, so every
method runs (slowly) on CPU.
"""

from __future__ import annotations

import numpy as np
import torch

from .cuda_driver import in_host_function, memcpy_async

# The slot and head of every block travel in the same copy as the keys and values, in a header of int32s that is
# padded so that the key and value blocks after it start on an aligned address (vectorised loads in the scatter).
_HEADER_ALIGN_BYTES = 128


def _page_bytes(page_size: int, head_dim: int, dtype: torch.dtype) -> int:
    return page_size * head_dim * dtype.itemsize


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


class CpuPageStore:
    """A layer's pages in CPU memory (pinned when asked and CUDA is present).

    Capacity grows to what is asked, and by at least an eighth: a prompt's pages arrive in one write (doubling
    would round 9,000 pages at 128k tokens up to 16,384, 0.9 GB of pinned memory per layer where 0.5 GB is used),
    later pages a few at a time (an eighth keeps their copies amortised).

    ``key_pages`` and ``value_pages`` are views ``[n_pages, n_kv_heads, page_size, head_dim]`` of the used part of
    the storage: ``n_pages`` is the highest page count asked for through ``ensure_capacity`` or ``write_pages``.
    The views change when the storage grows, so take them again after a write rather than keeping them.
    """

    def __init__(
        self,
        n_kv_heads: int,
        page_size: int,
        head_dim: int,
        dtype: torch.dtype,
        pin_memory: bool,
        initial_pages: int = 64,
    ):
        self.n_kv_heads = n_kv_heads
        self.page_size = page_size
        self.head_dim = head_dim
        self.dtype = dtype
        # Pinning needs a CUDA driver; without one the store is ordinary memory and the loader copies on CPU.
        self.pinned = bool(pin_memory) and torch.cuda.is_available()
        self.n_pages = 0
        self._keys = self._allocate(max(1, initial_pages))
        self._values = self._allocate(max(1, initial_pages))
        self._block_rows: tuple[np.ndarray, np.ndarray] | None = None

    def _allocate(self, capacity: int) -> torch.Tensor:
        shape = (capacity, self.n_kv_heads, self.page_size, self.head_dim)
        # Pinning allocates through CUDA, which a CUDA host function must not call: growth there is pageable (the
        # pages reach the GPU through a pinned transit buffer anyway); ``reserve`` between steps avoids it.
        pin = self.pinned and not in_host_function()
        # Zeroed: unused slots of a page must be finite, since a masked-out slot still meets a zero weight.
        return torch.zeros(shape, dtype=self.dtype, pin_memory=pin)

    @property
    def capacity(self) -> int:
        return self._keys.shape[0]

    @property
    def key_pages(self) -> torch.Tensor:
        return self._keys[: self.n_pages]

    @property
    def value_pages(self) -> torch.Tensor:
        return self._values[: self.n_pages]

    def ensure_capacity(self, n_pages: int) -> None:
        """Make pages ``0 .. n_pages-1`` addressable, growing the storage if needed (contents kept)."""
        self.reserve(n_pages)
        self.n_pages = max(self.n_pages, n_pages)

    def reserve(self, n_pages: int) -> None:
        """Grow the storage (contents kept) so that ``n_pages`` pages fit, without making them addressable."""
        if n_pages > self.capacity:
            capacity = max(n_pages, self.capacity + max(1, self.capacity // 8))
            keys, values = self._allocate(capacity), self._allocate(capacity)
            keys[: self.n_pages].copy_(self._keys[: self.n_pages])
            values[: self.n_pages].copy_(self._values[: self.n_pages])
            self._keys, self._values = keys, values
            self._block_rows = None

    def block_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The whole key and value storage as numpy byte arrays ``[capacity * n_kv_heads, page_bytes]``: row
        ``p * n_kv_heads + h`` is page ``p`` of head ``h``. They share memory with the store (until it grows)."""
        if self._block_rows is None:
            self._block_rows = tuple(
                pages.view(torch.uint8).view(-1, _page_bytes(self.page_size, self.head_dim, self.dtype)).numpy()
                for pages in (self._keys, self._values)
            )
        return self._block_rows

    def write_pages(
        self, page_ids: torch.Tensor, heads: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store ``keys[i]``/``values[i]`` (``[page_size, head_dim]`` each) as page ``page_ids[i]`` of head
        ``heads[i]``."""
        if page_ids.numel() == 0:
            return
        page_ids = page_ids.to("cpu", torch.long)
        heads = heads.to("cpu", torch.long)
        self.ensure_capacity(int(page_ids.max()) + 1)
        self._keys[page_ids, heads] = keys.to("cpu", self.dtype)
        self._values[page_ids, heads] = values.to("cpu", self.dtype)

    def write_pages_from_rows(
        self, page_ids: np.ndarray, heads: np.ndarray, key_rows: torch.Tensor, value_rows: torch.Tensor,
        source_rows: np.ndarray,
    ) -> None:
        """Lay out page ``page_ids[i]`` of head ``heads[i]`` from rows of ``key_rows``/``value_rows [R, D]``: its slot
        ``j`` takes row ``source_rows[i, j]``, or zeros where that is -1. Row copies over PyTorch's threads, straight
        into the store (no ``[n, page_size, D]`` temporaries, no masking pass): IceCache rewrites every page of a
        layer this way after its prompt's index build."""
        if page_ids.size == 0:
            return
        self.ensure_capacity(int(page_ids.max()) + 1)
        slots = np.arange(self.page_size)
        destination = ((page_ids[:, None] * self.n_kv_heads + heads[:, None]) * self.page_size + slots).reshape(-1)
        source = source_rows.reshape(-1)
        padding = source < 0
        destination_t = torch.from_numpy(destination)
        source_t = torch.from_numpy(np.where(padding, 0, source))
        padded_t = torch.from_numpy(destination[padding]) if padding.any() else None
        for rows, storage in ((key_rows, self._keys), (value_rows, self._values)):
            flat = storage.view(-1, self.head_dim)
            flat.index_copy_(0, destination_t, rows.index_select(0, source_t).to(self.dtype))
            if padded_t is not None:
                flat[padded_t] = 0

    def nbytes(self) -> int:
        """CPU bytes held (the whole capacity, which is what the process holds, pinned or not)."""
        return self._keys.nbytes + self._values.nbytes


def scatter_pages_reference(
    transit_keys: torch.Tensor,
    transit_values: torch.Tensor,
    pool_keys: torch.Tensor,
    pool_values: torch.Tensor,
    slots: torch.Tensor,
    heads: torch.Tensor,
) -> None:
    """Write block ``i`` of ``transit_keys``/``transit_values [n, S, D]`` into ``pool[slots[i], heads[i]]``.

    The PyTorch counterpart of ``triton_kernels.scatter_pages`` (values cast to the pool dtype;
    ``(slots[i], heads[i])`` pairs must be distinct; entries with a negative slot are padding and skipped).
    """
    used = slots >= 0
    if not bool(used.all()):
        transit_keys = transit_keys[used.to(transit_keys.device)]
        transit_values = transit_values[used.to(transit_values.device)]
        slots, heads = slots[used], heads[used.to(heads.device)]
    index = (slots.to(pool_keys.device, torch.long), heads.to(pool_keys.device, torch.long))
    pool_keys.index_put_(index, transit_keys.to(pool_keys.device, pool_keys.dtype))
    pool_values.index_put_(index, transit_values.to(pool_values.device, pool_values.dtype))


def scatter_pages(
    transit_keys: torch.Tensor,
    transit_values: torch.Tensor,
    pool_keys: torch.Tensor,
    pool_values: torch.Tensor,
    slots: torch.Tensor,
    heads: torch.Tensor,
) -> None:
    """Dispatch: the Triton scatter on CUDA when available, ``scatter_pages_reference`` otherwise."""
    if pool_keys.is_cuda:
        from . import triton_kernels

        if triton_kernels.available():
            triton_kernels.scatter_pages(transit_keys, transit_values, pool_keys, pool_values, slots, heads)
            return
    scatter_pages_reference(transit_keys, transit_values, pool_keys, pool_values, slots, heads)


class BulkLoader:
    """The shared CPU -> GPU transfer path: gather, one copy, scatter.

    ``load`` moves page ``(page_ids[i], heads[i])`` of a ``CpuPageStore`` into slot ``(slots[i], heads[i])`` of a
    ``GpuPagePool`` and touches nothing else. On CUDA:

    1. the blocks are gathered (one thread's copy loop for small loads, ``index_select`` over PyTorch's threads for
       large ones) into one contiguous pinned transit buffer, after the slot and head indices;
    2. one non-blocking host-to-device copy on a side stream moves the whole buffer to a GPU transit buffer (the
       side stream waits only for the previous scatter out of that buffer, so the copy overlaps earlier kernels);
    3. the current stream waits for that copy (on the device, the host does not block) and one scatter kernel
       writes each block into its slot.

    Both transit buffers are preallocated for ``max_pages`` blocks and grow when a load needs more. The host only
    waits when it must: before overwriting the pinned buffer that the previous copy may still be reading. With a
    CPU pool the same call uses index operations directly.
    """

    #: Loads of at most this many key and value bytes are gathered by one thread (see ``gather``).
    serial_gather_max_bytes: int = 8 << 20

    def __init__(
        self, page_size: int, head_dim: int, dtype: torch.dtype, device: torch.device | str, max_pages: int
    ):
        self.page_size = page_size
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self._host_buffer = torch.empty(0, dtype=torch.uint8)
        self._host_bytes = self._host_buffer.numpy()
        self._device_buffer = torch.empty(0, dtype=torch.uint8)
        if self.on_cuda:
            self._stream = torch.cuda.Stream(self.device)
            self._copy_done = torch.cuda.Event()
            self._scatter_done = torch.cuda.Event()  # never recorded yet: a stream waiting on it does not wait
            self._copy_pending = False
            self._reserve(self._transit_bytes(max_pages, dtype))

    def _transit_bytes(self, n_blocks: int, dtype: torch.dtype) -> int:
        return self._header_bytes(n_blocks) + 2 * n_blocks * _page_bytes(self.page_size, self.head_dim, dtype)

    @staticmethod
    def _header_bytes(n_blocks: int) -> int:
        raw = 2 * n_blocks * 4  # int32 slots, then int32 heads
        return -(-raw // _HEADER_ALIGN_BYTES) * _HEADER_ALIGN_BYTES

    def _reserve(self, n_bytes: int) -> None:
        if n_bytes <= self._host_buffer.numel():
            return
        n_bytes = max(n_bytes, 2 * self._host_buffer.numel())
        # The old buffers may still be in use by a copy or the scatter; let them finish before freeing them.
        torch.cuda.synchronize(self.device)
        self._copy_pending = False
        self._host_buffer = torch.empty(n_bytes, dtype=torch.uint8, pin_memory=True)
        self._host_bytes = self._host_buffer.numpy()  # the same pinned memory, for the numpy gather
        self._device_buffer = torch.empty(n_bytes, dtype=torch.uint8, device=self.device)

    def transit_nbytes(self) -> tuple[int, int]:
        """(pinned host bytes, device bytes) held by the transit buffers."""
        return self._host_buffer.numel(), self._device_buffer.numel()

    def load(
        self,
        store: CpuPageStore,
        page_ids: torch.Tensor | np.ndarray,
        heads: torch.Tensor | np.ndarray,
        pool: GpuPagePool,
        slots: torch.Tensor | np.ndarray,
    ) -> int:
        """Copy page ``(page_ids[i], heads[i])`` of ``store`` into ``pool[slots[i], heads[i]]``; returns the key and
        value bytes moved. ``(slots[i], heads[i])`` pairs must be distinct. The indices are CPU or device tensors or
        numpy arrays (numpy int64 is used as is). Asynchronous on CUDA: later work on the current stream sees the
        pages; the host does not wait for them."""
        # The indices are handled as numpy arrays: a reduction or an elementwise op on ~100 integers costs about a
        # microsecond there, several times less than a PyTorch op.
        page_np, heads_np, slots_np = _index_array(page_ids), _index_array(heads), _index_array(slots)
        n = page_np.size
        if not (heads_np.size == slots_np.size == n):
            raise ValueError(f"page_ids, heads and slots must have one entry per block, got {n}, {heads_np.size}, "
                             f"{slots_np.size}")
        if (store.page_size, store.head_dim, store.n_kv_heads) != (pool.page_size, pool.head_dim, pool.n_kv_heads):
            raise ValueError("the CPU store and the GPU pool have different page geometry")
        if n == 0:
            return 0
        if page_np.min() < 0 or page_np.max() >= store.n_pages:
            raise IndexError(f"page id out of range [0, {store.n_pages})")
        if heads_np.min() < 0 or heads_np.max() >= store.n_kv_heads:
            raise IndexError(f"head out of range [0, {store.n_kv_heads})")
        if slots_np.min() < 0 or slots_np.max() >= pool.n_slots:
            raise IndexError(f"slot out of range [0, {pool.n_slots})")
        kv_bytes = 2 * n * _page_bytes(self.page_size, self.head_dim, store.dtype)
        if not pool.key_pages.is_cuda:
            page_ids, heads = torch.from_numpy(page_np), torch.from_numpy(heads_np)
            keys = store.key_pages[page_ids, heads]
            values = store.value_pages[page_ids, heads]
            scatter_pages_reference(keys, values, pool.key_pages, pool.value_pages, torch.from_numpy(slots_np), heads)
            return kv_bytes
        if not self.on_cuda:
            raise ValueError(f"this loader was made for {self.device}, the pool is on {pool.device}")
        return self._load_cuda(store, page_np, heads_np, pool, slots_np, kv_bytes)

    def _load_cuda(
        self,
        store: CpuPageStore,
        page_ids: np.ndarray,
        heads: np.ndarray,
        pool: GpuPagePool,
        slots: np.ndarray,
        kv_bytes: int,
    ) -> int:
        n = page_ids.shape[0]
        header = self._header_bytes(n)
        total = header + kv_bytes
        self._reserve(total)
        if self._copy_pending:
            self._copy_done.synchronize()  # the previous copy may still be reading the pinned buffer

        host_index = self._host_bytes[: 2 * n * 4].view(np.int32).reshape(2, n)
        host_index[0] = slots
        host_index[1] = heads
        # Page (p, h) is row p * Hkv + h of the store seen as a list of page blocks.
        rows = page_ids * store.n_kv_heads + heads
        self.gather(store, rows, self._host_bytes[header:total].reshape(2, n, -1))

        current = torch.cuda.current_stream(self.device)
        # The previous scatter may still be reading the device transit buffer. Waiting for that scatter alone, not
        # for everything queued on the current stream, lets the copy run while the model's earlier kernels do.
        self._stream.wait_event(self._scatter_done)
        host = self._host_buffer[:total]
        device_buffer = self._device_buffer[:total]
        with torch.cuda.stream(self._stream):
            device_buffer.copy_(host, non_blocking=True)
        self._copy_done.record(self._stream)
        self._copy_pending = True
        current.wait_event(self._copy_done)

        device_index = device_buffer[: 2 * n * 4].view(torch.int32).view(2, n)
        device_blocks = device_buffer[header:total].view(store.dtype).view(2, n, self.page_size, self.head_dim)
        scatter_pages(
            device_blocks[0], device_blocks[1], pool.key_pages, pool.value_pages, device_index[0], device_index[1]
        )
        self._scatter_done.record(current)
        return kv_bytes

    def gather(self, store: CpuPageStore, rows: np.ndarray, out: np.ndarray) -> None:
        """Copy store rows ``rows`` (``page * n_kv_heads + head``) of the keys into ``out[0]`` and of the values into
        ``out[1]`` (``out`` is ``[2, n, page_bytes]`` bytes); see ``gather_blocks``."""
        gather_blocks(store, rows, out[0], out[1], self.serial_gather_max_bytes)


def gather_blocks(
    store: CpuPageStore, rows: np.ndarray, out_keys: np.ndarray, out_values: np.ndarray,
    serial_max_bytes: int = BulkLoader.serial_gather_max_bytes,
) -> None:
    """Copy store rows ``rows`` (``page * n_kv_heads + head``, range-checked by the caller) of the keys into
    ``out_keys`` and of the values into ``out_values`` (``[n, page_bytes]`` bytes each).

    Up to ``serial_max_bytes`` this is one thread's copy loop (numpy ``take``: a ``memcpy`` per block, ~20 us for
    768 KiB). PyTorch's ``index_select`` splits the same copy over its OpenMP threads, and waking them dominated
    small loads: 1.5 ms for 768 KiB on the H200 VM, and 3 ms on a busy 2-core machine, against 10 us when they
    happen to be awake. Large loads, where bandwidth matters, still use it.
    """
    key_rows, value_rows = store.block_rows()
    if out_keys.nbytes + out_values.nbytes <= serial_max_bytes:
        # 'clip' rather than the default 'raise', which would copy through a temporary buffer
        np.take(key_rows, rows, axis=0, out=out_keys, mode="clip")
        np.take(value_rows, rows, axis=0, out=out_values, mode="clip")
    else:
        index = torch.from_numpy(rows)
        for source, target in ((key_rows, out_keys), (value_rows, out_values)):
            torch.index_select(torch.from_numpy(source), 0, index, out=torch.from_numpy(target))


class StepTransit:
    """A layer's fixed-size exchange between the device and the host at every decode step, for a step that may be
    captured in a CUDA graph (every copy has the same size and address at every step).

    To the host (``inputs``, float32 ``[n_heads + 2 * n_kv_heads, head_dim]``): the step's query and the new
    token's key and value. To the device (one byte buffer, one copy): the flat pool rows the new token is written
    to, the valid-token count of every slot, and up to ``max_blocks`` page blocks with their slot and head (slot
    -1: an unused entry, skipped by the scatter). A step sends all ``max_blocks`` whether it loads them or not:
    at 8 KV heads and 12 selected pages of 16 bf16 tokens that is 0.8 MB, ~16 us of PCIe per layer, the price of
    a copy whose size the host need not decide before the step.

    On CPU the "device" views are the host arrays themselves and nothing is copied.
    """

    def __init__(
        self, n_heads: int, n_kv_heads: int, n_slots: int, max_blocks: int, page_size: int, head_dim: int,
        block_dtype: torch.dtype, device: torch.device, trace_width: int = 0,
    ):
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.max_blocks = max_blocks
        self.block_shape = (page_size, head_dim)
        self.block_dtype = block_dtype
        pin = self.on_cuda
        self.inputs_host = torch.zeros(n_heads + 2 * n_kv_heads, head_dim, dtype=torch.float32, pin_memory=pin)
        self.inputs_device = torch.zeros_like(self.inputs_host, device=self.device) if pin else self.inputs_host
        self.inputs = self.inputs_host.numpy()  # the same memory

        page_bytes = _page_bytes(page_size, head_dim, block_dtype)
        sections = (("window_rows", n_kv_heads * 8), ("counts", n_kv_heads * n_slots * 4), ("slots", max_blocks * 4),
                    ("heads", max_blocks * 4), ("keys", max_blocks * page_bytes), ("values", max_blocks * page_bytes))
        if trace_width:  # with a fixed trace width: the step's trace, one byte per (KV head, position)
            sections += (("attended", n_kv_heads * trace_width),)
        offsets, cursor = {}, 0
        for name, size in sections:
            cursor = -(-cursor // _HEADER_ALIGN_BYTES) * _HEADER_ALIGN_BYTES  # each section aligned for vector loads
            offsets[name] = (cursor, cursor + size)
            cursor += size
        self.outputs_host = torch.zeros(cursor, dtype=torch.uint8, pin_memory=pin)
        self.outputs_device = torch.zeros(cursor, dtype=torch.uint8, device=self.device) if pin else self.outputs_host

        def views(buffer: torch.Tensor) -> dict[str, torch.Tensor]:
            part = {name: buffer[begin:end] for name, (begin, end) in offsets.items()}
            return {
                "window_rows": part["window_rows"].view(torch.int64),
                "counts": part["counts"].view(torch.int32).view(n_kv_heads, n_slots),
                "slots": part["slots"].view(torch.int32),
                "heads": part["heads"].view(torch.int32),
                "keys": part["keys"].view(block_dtype).view(max_blocks, page_size, head_dim),
                "values": part["values"].view(block_dtype).view(max_blocks, page_size, head_dim),
                **({"attended": part["attended"].view(n_kv_heads, trace_width)} if trace_width else {}),
            }

        self.host = {name: view.numpy() if name not in ("keys", "values") else view.view(torch.uint8).view(
            max_blocks, page_bytes).numpy() for name, view in views(self.outputs_host).items()}
        self.device_views = views(self.outputs_device)
        self.host["slots"].fill(-1)

    def inputs_to_host(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Stage ``query [Hq, D]``, ``key`` and ``value [Hkv, D]`` for the host (asynchronous on CUDA)."""
        staged = self.inputs_device
        staged[: self.n_heads].copy_(query)
        staged[self.n_heads : self.n_heads + self.n_kv_heads].copy_(key)
        staged[self.n_heads + self.n_kv_heads :].copy_(value)
        if self.on_cuda:
            copy_async(self.inputs_host, staged)

    def outputs_to_device(self) -> None:
        """Send what the host wrote to the device views (asynchronous on CUDA; nothing to do on CPU)."""
        if self.on_cuda:
            copy_async(self.outputs_device, self.outputs_host)

    def nbytes(self) -> tuple[int, int]:
        """(pinned host bytes, device bytes) held."""
        host = self.inputs_host.nbytes + self.outputs_host.nbytes
        return host, (host if self.on_cuda else 0)


def copy_async(destination: torch.Tensor, source: torch.Tensor) -> None:
    """A non-blocking copy between pinned host and device memory on the current stream: PyTorch's when running
    eagerly, the driver's raw copy inside a CUDA-graph capture (``cuda_driver``)."""
    if torch.cuda.is_current_stream_capturing():
        memcpy_async(destination, source)
    else:
        destination.copy_(source, non_blocking=True)


def _index_array(indices: torch.Tensor | np.ndarray) -> np.ndarray:
    """A flat CPU int64 numpy array of ``indices`` (no copy when they already are CPU int64)."""
    if isinstance(indices, np.ndarray):
        return indices.astype(np.int64, copy=False).reshape(-1)
    if indices.device.type != "cpu" or indices.dtype != torch.long:
        indices = indices.to("cpu", torch.long)
    return indices.reshape(-1).numpy()


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


def copy_blocks(
    source_keys: torch.Tensor, source_values: torch.Tensor, pages: torch.Tensor,
    target_keys: torch.Tensor, target_values: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor,
) -> None:
    """Dispatch: on CUDA with Triton one kernel whose skipped entries move no byte (the source may be mapped host
    memory, ``mapped_device_view``, so a skipped entry saves a PCIe read); otherwise ``copy_blocks_reference``."""
    from . import triton_kernels

    if target_keys.is_cuda and triton_kernels.available():
        triton_kernels.copy_blocks(source_keys, source_values, pages, target_keys, target_values, slots, heads)
    else:
        copy_blocks_reference(source_keys, source_values, pages, target_keys, target_values, slots, heads)
