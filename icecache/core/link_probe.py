"""How fast this CUDA host's GPU reads pinned host memory, the way the offloading methods read it.

ShadowKV, ArkVale and PQCache recall KV blocks from a pinned host store with ``copy_blocks`` over a mapped view of it
(``paged.mapped_device_view``, zero-copy): the GPU's own loads cross PCIe, a few KB at a time, from anywhere in a store
of tens of GB. What such a read can reach on a given host is what bounds those methods' copies, and it is not the
link's headline rate. The probe measures, on one pinned store:

* ``dma_gbps``: one large contiguous host-to-device copy by the copy engines (``Tensor.copy_``): the link's rate;
* ``zero_copy_gbps[block]``: ``copy_blocks_triton`` moving ``entries`` blocks of ``block`` bytes each, in two arrays
  as the methods call it, from distinct random places in the store (``random``) and from consecutive places
  (``sequential``): the methods' pattern, and what the same kernel reaches without the scattering; and from random
  places with 4 and 16 entries a program (``random_4_a_program``, ``random_16_a_program``): more bytes in flight
  per program; and from random places by 32 programs taking the blocks in turn (``random_32_programs``, the launch
  of PQCache's block-cache update): what a copy that leaves most SMs to other kernels reaches.

Each figure is the median of ``repeats`` timed launches (CUDA events) after two warm-up launches; bytes moved per
second, counting what crossed the link (both arrays); every launch's bytes are checked against the store. ``measure``
prints nothing and returns a dict; ``format_table`` renders it; scripts/bench/link.py is the command line, which the
throughput benchmark runs in a process of its own (the store's pinned pages go back to the system when it ends)
and records in its file's settings as ``link``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from .device_timing import median_event_seconds
from .kernels.block_copy import copy_blocks_triton
from .kernels.triton_runtime import available as triton_available
from .paged import mapped_device_view

DEFAULT_STORE_BYTES = 2 << 30
DEFAULT_BLOCK_BYTES = (1024, 2048, 4096, 8192)
DEFAULT_ENTRIES = 4096
DEFAULT_REPEATS = 20
DMA_BYTES = 256 << 20
#: The block copies timed per block size: (name, order of the blocks, ``copy_blocks_triton``'s launch arguments).
VARIANTS = (("random", "random", {}), ("sequential", "sequential", {}),
            ("random_4_a_program", "random", {"entries_per_program": 4}),
            ("random_16_a_program", "random", {"entries_per_program": 16}),
            ("random_32_programs", "random", {"programs": 32}))
ELEMENT = torch.bfloat16
REPO = Path(__file__).resolve().parents[2]


def run_probe_process(arguments: list[str]) -> subprocess.CompletedProcess:
    """scripts/bench/link.py with ``arguments`` in a process of its own (its output captured as text), with this
    repository on its PYTHONPATH: a checkout run without installing the package imports it from there."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "link.py"), *arguments],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": path})


def block_plan(n_blocks: int, entries: int, order: str, generator: torch.Generator) -> torch.Tensor:
    """``entries`` distinct block numbers below ``n_blocks``: a random draw, or consecutive ones from a random start."""
    if entries > n_blocks:
        raise ValueError(f"{entries} entries need a store of at least {entries} blocks, not {n_blocks}")
    if order == "random":
        return torch.randperm(n_blocks, generator=generator)[:entries]
    if order == "sequential":
        start = int(torch.randint(0, n_blocks - entries + 1, (1,), generator=generator))
        return torch.arange(start, start + entries)
    raise ValueError(f"order must be 'random' or 'sequential', not {order!r}")


def copy_arguments(store: torch.Tensor, target: torch.Tensor, pages: torch.Tensor) -> dict[str, torch.Tensor]:
    """``copy_blocks`` arguments that move blocks ``pages`` of each half of ``store`` into ``target[0]`` and
    ``target[1]``, slots 0..n-1: the store's two halves are its two arrays (as ShadowKV passes a chunk's two halves),
    one head; ``pages`` lie below half the store's blocks."""
    half = store.shape[0] // 2
    device = target.device
    pages = pages.to(device)
    if pages.numel() and int(pages.max()) >= half:
        raise ValueError(f"block {int(pages.max())} lies past the store's first half ({half} blocks)")
    return {"source_keys": store[:half], "source_values": store[half:], "pages": pages,
            "target_keys": target[0], "target_values": target[1],
            "slots": torch.arange(pages.numel(), device=device, dtype=torch.int64),
            "heads": torch.zeros(pages.numel(), device=device, dtype=torch.int64)}


def measure(device: torch.device | str | None = None, store_bytes: int = DEFAULT_STORE_BYTES,
            block_bytes: tuple[int, ...] = DEFAULT_BLOCK_BYTES, entries: int = DEFAULT_ENTRIES,
            repeats: int = DEFAULT_REPEATS, seed: int = 0) -> dict[str, Any]:
    """The link's copy-engine rate and the zero-copy block reads' rates (GB/s) on this host."""
    if not torch.cuda.is_available():
        raise RuntimeError("the link probe needs a CUDA device")
    if not triton_available():
        raise RuntimeError("the link probe needs Triton (the methods' block copy)")
    device = torch.device(device if device is not None else "cuda")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    element_bytes = torch.empty((), dtype=ELEMENT).element_size()
    generator = torch.Generator().manual_seed(seed)
    pinned = torch.empty(store_bytes // element_bytes, dtype=ELEMENT, pin_memory=True)
    pinned.view(torch.int16).random_(generator=generator)
    mapped = mapped_device_view(pinned, device)
    dma_source = pinned[: min(DMA_BYTES, store_bytes) // element_bytes]
    dma_target = torch.empty_like(dma_source, device=device)
    dma_s = median_event_seconds(lambda: dma_target.copy_(dma_source, non_blocking=True), device, repeats)
    if not torch.equal(dma_target.cpu().view(torch.int16), dma_source.view(torch.int16)):  # bits: NaNs too
        raise RuntimeError("the copy engines' copy moved the wrong bytes")
    rates: dict[str, dict[str, float]] = {}
    for size in block_bytes:
        elements = size // element_bytes
        # [block, head, page_size, head_dim] with one head and one page row: a block is `elements` contiguous values
        store = mapped[: pinned.numel() // elements * elements].view(-1, 1, 1, elements)
        target = torch.empty((2, entries, 1, 1, elements), dtype=ELEMENT, device=device)
        rates[str(size)] = {}
        for name, order, launch in VARIANTS:
            pages = block_plan(store.shape[0] // 2, entries, order, generator)
            arguments = copy_arguments(store, target, pages)
            target.zero_()
            seconds = median_event_seconds(lambda arguments=arguments, launch=launch: copy_blocks_triton(
                **arguments, **launch), device, repeats)
            moved = target[0].flatten(1).view(torch.int16), target[1].flatten(1).view(torch.int16)
            wanted = [arguments[array][arguments["pages"]].flatten(1).view(torch.int16)
                      for array in ("source_keys", "source_values")]
            if not (torch.equal(moved[0], wanted[0]) and torch.equal(moved[1], wanted[1])):
                raise RuntimeError(f"the block copy moved the wrong bytes ({size} B blocks, {name})")
            rates[str(size)][name] = 2 * entries * size / seconds / 1e9
    del mapped
    return {
        "device": torch.cuda.get_device_name(device),
        "store_gib": store_bytes / 2**30,
        "entries": entries,
        "repeats": repeats,
        "dma_bytes": dma_source.numel() * element_bytes,
        "dma_gbps": dma_source.numel() * element_bytes / dma_s / 1e9,
        "zero_copy_gbps": rates,
    }


def format_table(result: dict[str, Any]) -> str:
    """The probe's result as a short text table."""
    lines = [f"host-to-GPU reads on {result['device']} (a {result['store_gib']:.0f} GiB pinned store, "
             f"{result['entries']} blocks a launch in two arrays, median of {result['repeats']})",
             f"  {'copy engines, one ' + str(result.get('dma_bytes', DMA_BYTES) >> 20) + ' MiB copy':<40} "
             f"{result['dma_gbps']:6.1f} GB/s"]
    for size, by_order in result["zero_copy_gbps"].items():
        per_program = "".join(f", {by_order[name]:.1f} {label}" for name, label in
                              (("random_4_a_program", "with 4 a program"), ("random_16_a_program", "with 16 a program"),
                               ("random_32_programs", "by 32 programs in turn")) if name in by_order)
        lines.append(f"  {f'zero-copy blocks of {size} B':<40} {by_order['random']:6.1f} GB/s random, "
                     f"{by_order['sequential']:6.1f} GB/s sequential{per_program}")
    return "\n".join(lines)
