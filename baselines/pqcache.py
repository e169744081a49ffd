"""PQCache (Zhang et al., SIGMOD 2025): product-quantised keys choose the tokens whose KV comes from CPU memory.

**The paper.** After the prefill, each layer's keys are product-quantised per KV head: a key's ``D`` channels are
cut into ``m`` sub-vectors, each sub-space gets ``2**b`` centroids by k-means, and a key is kept as its ``m``
centroid indices. Keys and values go to CPU memory; the codes and centroids stay on the GPU. The clustering runs on
CPU threads while the GPU computes the next layers' prefill. At each decode step a query head scores every middle
token with ``sum_j q_j . c_j[code_j]`` (a table of query-centroid products, then lookups), the softmax of those
approximate scores is summed over each GQA group, and the top tokens of every KV head are fetched from CPU memory;
attention runs exactly over the initial (sink) tokens, the local window and the fetched tokens. A token leaving the
local window gets the code of its nearest centroids. A GPU block cache (blocks of consecutive tokens, LFU) keeps
the blocks that the selections hit most, so that part of a step's tokens need no transfer.

**Settings (the paper's Llama-3.1 runs).** ``m = 2`` sub-spaces, ``b = 6`` bits (64 centroids per sub-space),
Euclidean k-means seeded with a random sample of the keys, 32 initial tokens, half of the rest of the budget for
the local window, every layer compressed (``n_dense_layers: 0``); the block cache holds 4096 tokens in blocks of 128 and
takes the 32 blocks with the most selected tokens at each step.

**The budget** (the harness's one meaning: tokens a query head attends at a decode step): ``n_sink_tokens`` initial
tokens + ``n_local = int(local_ratio * (budget - n_sink_tokens))`` most recent tokens (the new one included) + ``n_topk
= budget - n_sink_tokens - n_local`` selected middle tokens (PQCache's ``topk_size``). At budget 256: 32 + 112 + 112.
PQCache sizes its parts as fractions of the prompt; here they are the budget's. When the middle has no more than
``n_topk`` tokens every token is attended. Needs ``budget >= n_sink_tokens + 2`` at ``local_ratio = 0.5``.

**This code.** The window is a ``RingSlotsKV`` of ``budget`` slots per KV head: the sinks pinned, the local window a
ring, and the last ``n_topk`` slots holding the step's selection. After the prompt, every token's key and value is in a
host store (pinned on CUDA, read in place through ``core.paged.mapped_device_view``). On CUDA, a layer's prompt is
copied into the store (one asynchronous copy per KV head, the core's prompt copies: ``core.host_memory``, into buffers
the method keeps from one sequence to the next) on the sequence's copy stream, waiting for the model's stream only for
the keys, so that layer ``l``'s copy and k-means run beside layer ``l + 1``'s prefill. Where the k-means runs is
``kmeans_on``: ``host``, as PQCache does, on a worker thread of the sequence from the store's keys once their copy is
done (the layer's first decode step waits for its codebooks and copies them to the device); ``device``, on the GPU from
the device's keys on a side stream of its own (the first decode step makes the model's stream wait for it, with no host
synchronisation). Either way TT2T includes what is left of the wait. On a CPU model the worker thread runs the layers'
k-means, layer after layer, while the prefill goes on. The codes are kept on the device as int32 rows
``(h * m + j) * C + code`` of the query-centroid table. The k-means is seeded with distinct keys drawn on the CPU with
``seed + layer`` (the same draw on every device: the keys whose uniform draws are smallest, equal draws in index order,
``product_quantization.smallest_draws``). Each step, on the device: the new token goes to the ring and the host store
and is encoded; ``core.kernels.pq_votes`` scores every token through the table (``core.product_quantization.pq_scores``)
and gives the candidates (after the sinks, before the window) a softmax per query head, summed per KV head (on CUDA two
Triton kernels); a top-k on keys that order by vote, then by position (``core.kernels.stable_topk``), keeps the
``n_topk`` tokens per KV head that a stable sort would put first (tokens with the same codes tie; ties go to the earlier
position on every device; on CUDA a few Triton passes); the chosen tokens held by the block cache are gathered from it
and the others are read from the host store with ``copy_blocks`` (``core.kernels.block_copy``) (one kernel, skipped
entries read nothing); then the cache update: the ``cache_topk_blocks`` complete blocks with the most selected tokens
(all KV heads counted; ties to the lower block; only blocks with one at least) are inserted in LFU order (a hit adds one
to a block's count; a missing block takes an empty slot or evicts the slot with the lowest count, the oldest among
equals, never one of the step's blocks) and copied in from the host store; on CUDA the updates run on a side stream
beside the rest of the step, as in PQCache, and the last layer makes the model's stream wait for them all before the
step ends. The update's copy is the step's largest transfer (at 32k on Llama-3.1-8B about 460 of the 480 MB a step
reads from host memory, a block cache that the selections keep changing); it runs as ``cache_copy_programs``
programs taking the blocks in turn, a few programs' registers held while their PCIe reads are in flight, rather than
one program per (block, KV head) on every SM, so that the step's own kernels keep room to run beside it (on an H100,
21.0 against 30.2 ms a step at 32k, docs/performance.md). The step reads no host value, so on CUDA it replays
from a CUDA graph.

**Deviations.** The number of k-means iterations is fixed (``kmeans_iters``, default 10); PQCache's code picks it per
layer from a timing model so that clustering ends within the GPU's work on the following layers (3 to 300 iterations),
which would make results depend on the machine. An empty cluster keeps its centroid (scikit-learn moves it to a far
point). The host's k-means is one Python worker thread whose PyTorch operations use the process's CPU threads (PQCache
runs it on CPU processes pinned to cores); with ``kmeans_on: host`` a CUDA run's codebooks are the CPU run's, bit for
bit. The GPU's k-means (``kmeans_on: device``) is the CPU's algorithm from the same draw, each of its two passes one
kernel (``core.kernels.kmeans_passes``: the assignment's arg-min taken from products held in registers, the clusters'
sums added from one-hot slices in a fixed order, so the same bits at every run, where CUDA's ``scatter_add_`` is not),
so its codebooks equal the CPU's up to float32 rounding: a key whose two nearest centroids are equal to rounding may
take the other one, and then both centroids move a little. On PQCache's sizes (bfloat16 keys, 6 bits, 10 iterations) no
code of 65,536 differed between float32 and float64 k-means on the CPU, none of 96,000 between an H200 and the CPU
(``tests/test_pqcache.py`` bounds the GPU's share at one in a thousand); GPU and CPU runs may therefore choose different
tokens where a key is that close to a tie. A token's code is computed when it arrives rather than when it leaves the
window (the same code: the centroids are fixed after the prompt). The block cache takes a step's blocks as one batch
(PQCache's LFU inserts them one by one, so a block of a step can evict another of the same step), and only complete
blocks are cached. ``pages_loaded`` counts (token, KV head) entries read from host memory plus (block, KV head) blocks
copied into the cache; ``bytes_to_gpu`` their bytes. A prompt with fewer middle tokens than centroids makes every middle
token a centroid (exact scores); one with none leaves all centroids at zero, so later tokens score alike until they are
the middle.

**Long prompts, small budgets.** A key's code has ``m * b`` bits (12 by default), and the budget here is a fixed
number of tokens where PQCache's scripts keep a tenth of the prompt (half of it selected). At 32k tokens and budget
1024 the ``n_topk`` picks are 1.5% of the middle, and approximate scores that coarse rank tokens an exact score would
keep below them: on Qwen2.5-Coder-0.5B's passkey at 32k PQCache answers with the key's first digits and then strays
(0-15% of the keys at budgets 128-1024 on the GPU; the same with its CPU k-means). That is its resolution, not its
mechanics: with ``n_bits: 8`` it found 3 of 4 keys where the paper's 6 bits found none and the full cache all 4,
on the same samples (CPU, budget 1024; in results/bench,
``ab_pqcache_code_bits_passkey_32k_cpu_qwen2.5-coder-0.5b_20261206-105022.json``). The default stays the paper's. """

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from icecache.core.kernels.block_copy import copy_blocks
from icecache.core.kernels.kmeans_passes import pq_build as pq_build_on_device
from icecache.core.kernels.pq_votes import pq_votes
from icecache.core.kernels.stable_topk import stable_topk
from icecache.core.method import (
    METHODS,
    Method,
    MethodConfig,
    SpeedGoal,
    in_run_identity_unless_default,
    not_in_run_identity,
    prompt_offload_goals,
    storage_capacity,
)
from icecache.core.paged import mapped_device_view
from icecache.core.product_quantization import code_rows, pq_build, pq_encode
from icecache.core.token_slots import RingSlotsKV
from icecache.errors import ConfigError

#: Sort key of a slot held by one of the step's blocks: never a victim.
_HELD = torch.iinfo(torch.int64).max


class PQCacheSequence:
    """What a sequence's PQCache layers share: on the CPU the worker thread of their clusterings, ended with the
    sequence; on CUDA the side stream of the clusterings (it runs the layers' k-means in layer order, beside the
    prefill of the later layers on the model's stream; the host store's fill is the sequence's prompt copies)."""

    def __init__(self):
        self._worker: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.cache_streams: dict[torch.device, torch.cuda.Stream] = {}
        # The counters of the cache updates queued on the cache stream and not yet joined, in DecodeCounters'
        # device layout (float64 [steps, attended, pages, bytes]): added to on that stream only, folded into the
        # sequence's counters by the model's stream when it joins.
        self.cache_counts: dict[torch.device, torch.Tensor] = {}
        self.unjoined_updates: set[int] = set()  # layers whose cache update the model's stream has not waited for

    def worker(self) -> ThreadPoolExecutor:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="pqcache-kmeans")
        return self._worker

    def clustering_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def cache_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The stream of the layers' block-cache updates, each queued after its layer's fetch."""
        if device not in self.cache_streams:
            self.cache_streams[device] = torch.cuda.Stream(device)
            self.cache_counts[device] = torch.zeros(4, dtype=torch.float64, device=device)
        return self.cache_streams[device]

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


@dataclass
class PQCacheConfig(MethodConfig):
    name: str = "pqcache"
    n_dense_layers: int = 0  # PQCache compresses every layer
    n_subspaces: int = 2  # m: sub-vectors per key (PQCache's SUBVEC)
    n_bits: int = 6  # b: 2**b centroids per sub-space (SUBBITS)
    kmeans_iters: int = 10  # Lloyd iterations of each k-means (PQCache: adaptive, 3 to 300)
    n_sink_tokens: int = 32  # initial tokens, always attended (SINK_SIZE)
    local_ratio: float = 0.5  # share of budget - n_sink_tokens for the local window (RECENT_RATIO)
    cache_block_size: int = 128  # tokens per block of the GPU block cache
    cache_tokens: int = 4096  # tokens the block cache holds per layer (0: no cache)
    cache_topk_blocks: int = 32  # blocks offered to the cache at each step (the most selected ones)
    seed: int = 0  # k-means initialisation (layer l draws with seed + l)
    # Where a CUDA model's prompt k-means runs: "host" (CPU threads from the host store's copy, PQCache's design:
    # the GPU's prefill keeps every SM) or "device" (a side stream on the model's GPU). A CPU model runs it on the CPU.
    kmeans_on: str = in_run_identity_unless_default("device")
    # On CUDA, the programs of the block-cache update's copy, which runs on a side stream beside the step: that many
    # programs taking the (block, KV head) entries in turn (0: one program per entry, every entry at once, which
    # fills every SM and kept the step's kernels from running beside the copy). The same bytes either way.
    cache_copy_programs: int = not_in_run_identity(32)

    def min_budget(self) -> int:
        budget = self.n_sink_tokens + 2
        while min(budget_split(PQCacheConfig(budget=budget, n_sink_tokens=self.n_sink_tokens,
                                             local_ratio=self.local_ratio))) < 1:
            budget += 1
        return budget

    def min_budget_reason(self) -> str:
        return (f"n_sink_tokens={self.n_sink_tokens} + 1 local and 1 selected token at local_ratio="
                f"{self.local_ratio}")


def budget_split(config: PQCacheConfig) -> tuple[int, int]:
    """``(n_local, n_topk)``: the local window (the new token included) and the selected tokens of ``budget``."""
    rest = config.budget - config.n_sink_tokens
    n_local = max(1, int(config.local_ratio * rest))
    return n_local, rest - n_local


@dataclass
class _PendingCodebooks:
    """A CUDA layer's codebooks on their way: the clustering was queued on a side stream, ending with this event,
    which the layer's first decode step makes the model's stream wait for (and for the prompt copies)."""

    clustered: torch.cuda.Event


@torch.inference_mode()  # inference mode is per thread: the worker's tensors are made under it too
def _build_codebooks(host_keys: torch.Tensor, begin: int, end: int, config: PQCacheConfig, seed: int,
                     copied: torch.cuda.Event | None) -> tuple[torch.Tensor, torch.Tensor]:
    if copied is not None:
        copied.synchronize()  # the prompt's keys are still on their way to the host store
    generator = torch.Generator().manual_seed(seed)
    return pq_build(host_keys[:, begin:end], config.n_subspaces, config.n_bits, config.kmeans_iters, generator)


class PQCacheKV(RingSlotsKV):
    """Slots ``[0, n_sink)`` the sinks, ``[n_sink, W)`` the local window (a ring), ``[W, W + n_topk)`` the step's
    selection; all tokens in the host store ``[Hkv, capacity, D]``; codes, centroids and the block cache on the
    device."""

    def __init__(self, layer_idx, model, seq, config: PQCacheConfig):
        super().__init__(layer_idx, model, seq, config.budget)
        self.config = config
        self.n_local, self.n_topk = budget_split(config)
        self.n_pinned = self.ring_start = config.n_sink_tokens
        self.ring_size = self.n_local
        self.window = config.n_sink_tokens + self.n_local
        self.n_centroids = 2**config.n_bits
        self.block_size = config.cache_block_size
        self.n_cache_blocks = config.cache_tokens // config.cache_block_size
        self.capacity = 0
        self._codebooks: Future | _PendingCodebooks | None = None
        self._prompt_length = 0

    # --- prompt -----------------------------------------------------------------------------------------------
    def place_prompt(self, n_prompt):
        return self.pinned_then_recent(n_prompt)  # the sinks, then the local window

    def on_prompt_placed(self, kept, slots):
        super().on_prompt_placed(kept, slots)
        keys, values = self.keys[0], self.values[0]
        n_prompt = keys.shape[1]
        self._prompt_length = n_prompt
        begin = min(self.config.n_sink_tokens, n_prompt)
        seed = self.config.seed + self.layer_idx
        with self.seq.timer.phase("offload"):
            self._allocate(storage_capacity(self.seq, n_prompt + 1, 0), keys)
            if not keys.is_cuda:
                self.host_keys[:, :n_prompt].copy_(keys)
                self.host_values[:, :n_prompt].copy_(values)
                self._codebooks = self._worker().submit(_build_codebooks, self.host_keys, begin, n_prompt,
                                                        self.config, seed, None)
        if keys.is_cuda:
            # Queued after the timed phase, which times the model stream's part of the offload: the side streams'
            # work overlaps the next layers' prefill, timed or not (a phase waits for its own stream, core.timing).
            self._codebooks = KMEANS_PLACES[self.config.kmeans_on](self, keys, values, begin, seed)

    def _copy_prompt_to_host(self, keys: torch.Tensor, values: torch.Tensor) -> torch.cuda.Event:
        """The prompt's host-store fill (the sequence's prompt copies), after the model's stream has produced the
        keys and values; returns the event after which the store holds every key."""
        n_prompt = keys.shape[1]
        keys_copied = None
        # One copy per KV head: each head's rows are contiguous in the store, so each copy is one asynchronous DMA
        # into pinned memory (the strided [Hkv, :n] view is not one block). The copies run in order on one stream,
        # so the last key's event follows every key.
        for head in range(keys.shape[0]):
            keys_copied = self.seq.prompt_copies.copy(self.host_keys[head, :n_prompt], keys[head])
            self.seq.prompt_copies.copy(self.host_values[head, :n_prompt], values[head])
        return keys_copied

    def _cluster_on_host(self, keys: torch.Tensor, values: torch.Tensor, begin: int, seed: int) -> Future:
        """The prompt's host-store fill, then its k-means on the sequence's CPU worker from the store's keys once
        they are there (PQCache's design): layer ``l``'s copy and clustering run while layer ``l + 1``'s prefill
        runs, and the GPU's prefill shares its SMs with nothing. The codebooks are the CPU path's, bit for bit."""
        copied = self._copy_prompt_to_host(keys, values)
        return self._worker().submit(_build_codebooks, self.host_keys, begin, keys.shape[1], self.config, seed,
                                     copied)

    def _cluster_on_device(self, keys: torch.Tensor, values: torch.Tensor, begin: int,
                           seed: int) -> _PendingCodebooks:
        """The prompt's host-store fill and its k-means on the device, from the device's keys, on the clustering
        stream, each after the model's stream has produced the keys: layer ``l``'s copy and clustering run while
        layer ``l + 1``'s prefill runs. The dense prompt goes when the layer is done with it; the caching allocator
        reuses its memory only once the side streams are past their use of it (``record_stream``)."""
        n_prompt = keys.shape[1]
        self._copy_prompt_to_host(keys, values)
        clustering = self.seq.state(PQCacheSequence).clustering_stream(keys.device)
        produced = torch.cuda.current_stream(keys.device)
        pending = _PendingCodebooks(torch.cuda.Event())
        clustering.wait_stream(produced)
        with torch.cuda.stream(clustering):
            generator = torch.Generator().manual_seed(seed)  # the CPU's draw: the CPU path's initial centroids
            centroids, codes = pq_build_on_device(keys[:, begin:n_prompt], self.config.n_subspaces,
                                                  self.config.n_bits, self.config.kmeans_iters, generator)
            self.centroids.copy_(centroids)
            self.code_rows[..., begin:n_prompt] = code_rows(codes, self.n_centroids)
            pending.clustered.record(clustering)
        for tensor in (keys, self.centroids, self.code_rows):
            tensor.record_stream(clustering)
        return pending

    def _worker(self) -> ThreadPoolExecutor:
        # One worker per sequence: the layers' clusterings run in layer order, beside the prefill of later layers.
        return self.seq.state(PQCacheSequence).worker()

    def _allocate(self, needed: int, like: torch.Tensor) -> None:
        """Host store, codes and block-cache state for ``needed`` tokens (rounded up to whole blocks); what is
        there is kept (a store grows only outside the generation loop, which announces the length)."""
        capacity = -(-needed // self.block_size) * self.block_size
        n_kv_heads, head_dim, device = self.model.n_kv_heads, like.shape[-1], like.device
        pin = like.is_cuda
        # Not zeroed: a position is read only once written (skipped reads of copy_blocks read nothing).
        host_keys = self.seq.prompt_copies.take((n_kv_heads, capacity, head_dim), like.dtype, device)
        host_values = self.seq.prompt_copies.take((n_kv_heads, capacity, head_dim), like.dtype, device)
        rows = torch.zeros(n_kv_heads, self.config.n_subspaces, capacity, dtype=torch.int32, device=device)
        n_blocks = capacity // self.block_size
        block_slot = torch.full((n_blocks + 1,), -1, dtype=torch.long, device=device)  # + a scratch block
        if self.capacity:
            if pin:
                torch.cuda.synchronize(device)
            host_keys[:, : self.capacity] = self.host_keys
            host_values[:, : self.capacity] = self.host_values
            rows[..., : self.capacity] = self.code_rows
            block_slot[: self.block_slot.shape[0] - 1] = self.block_slot[:-1]
        else:
            sub_dim = head_dim // self.config.n_subspaces
            self.centroids = torch.zeros(n_kv_heads, self.config.n_subspaces, self.n_centroids, sub_dim,
                                         device=device)
            self._heads = torch.arange(n_kv_heads, device=device)
            self._picks = torch.arange(self.n_topk, device=device)
            # The fetch target: one row per pick plus a scratch row (copy_blocks' skipped entries).
            self.fetch_keys = like.new_zeros(self.n_topk + 1, n_kv_heads, 1, head_dim)
            self.fetch_values = like.new_zeros(self.n_topk + 1, n_kv_heads, 1, head_dim)
            n_slots = self.n_cache_blocks
            self.cache_keys = like.new_zeros(n_slots + 1, n_kv_heads, self.block_size, head_dim)  # + a scratch slot
            self.cache_values = like.new_zeros(n_slots + 1, n_kv_heads, self.block_size, head_dim)
            self.slot_block = torch.full((n_slots + 1,), -1, dtype=torch.long, device=device)
            self.slot_uses = torch.zeros(n_slots + 1, dtype=torch.long, device=device)
            self.slot_stamp = torch.zeros(n_slots + 1, dtype=torch.long, device=device)
        self.host_keys, self.host_values, self.code_rows, self.block_slot = host_keys, host_values, rows, block_slot
        self.capacity = capacity
        # The KV head of each flattened (head, pick) and (offered block, head) entry of copy_blocks, made once.
        heads = torch.arange(n_kv_heads, device=device)
        self._pick_heads = heads.repeat_interleave(min(self.n_topk, capacity))
        self._offer_heads = heads.repeat(min(self.config.cache_topk_blocks, n_blocks))
        if pin:
            keys_on_device = mapped_device_view(host_keys, device)
            values_on_device = mapped_device_view(host_values, device)
        else:
            keys_on_device, values_on_device = host_keys, host_values
        self._store_keys, self._store_values = keys_on_device, values_on_device
        # copy_blocks' views of the store: single tokens [T, Hkv, 1, D] and cache blocks [P, Hkv, block, D].
        self._token_keys = keys_on_device.permute(1, 0, 2).unsqueeze(2)
        self._token_values = values_on_device.permute(1, 0, 2).unsqueeze(2)
        self._block_keys = keys_on_device.view(n_kv_heads, n_blocks, self.block_size, head_dim).permute(1, 0, 2, 3)
        self._block_values = values_on_device.view(n_kv_heads, n_blocks, self.block_size, head_dim).permute(
            1, 0, 2, 3)
        self._block_ends = (torch.arange(n_blocks, device=device) + 1) * self.block_size

    def _install_codebooks(self) -> None:
        """The first decode step of the layer: wait for its k-means and put codes and centroids on the device (on
        CUDA they are there: the model's stream waits for the side streams, without a host synchronisation)."""
        pending, self._codebooks = self._codebooks, None
        self.seq.prompt_copies.join()  # the host store's fill (nothing on a CPU model)
        if isinstance(pending, _PendingCodebooks):
            torch.cuda.current_stream(self.centroids.device).wait_event(pending.clustered)
            return
        centroids, codes = pending.result()  # from the worker: CPU tensors, copied to the model's device here
        self.centroids.copy_(centroids)
        begin = min(self.config.n_sink_tokens, self._prompt_length)
        self.code_rows[..., begin : self._prompt_length] = code_rows(codes, self.n_centroids).to(self.code_rows.device)

    # --- decode -----------------------------------------------------------------------------------------------
    def decode(self, query, key, value, scaling):
        if query.shape[0] != 1:
            raise ValueError("sparse KV methods run with batch size 1")
        # A host branch a replay would skip, taken at the layer's first decode step only: the generation loop runs
        # that step eagerly (it warms up on it), so no captured step finds the codebooks pending.
        if self._codebooks is not None:
            with self.seq.timer.phase("select"):
                self._install_codebooks()
        if self.seq_len + 1 > self.capacity:  # only outside the generation loop
            self._allocate(2 * self.capacity, key)
        position = self.decode_position(key.device)
        self.write(self.next_slot(position), key[0], value[0], position)
        self._store_keys.index_copy_(1, position, key[0])
        self._store_values.index_copy_(1, position, value[0])
        new_rows = code_rows(pq_encode(key[0], self.centroids), self.n_centroids)
        self.code_rows.index_copy_(2, position, new_rows)

        q = query[0, :, 0]
        with self.seq.timer.phase("select"):
            picks, chosen = self.select(q, position, scaling)
        with self.seq.timer.phase("load"):
            self._fetch(picks, chosen, position)
        if self.seq.trace_selection:
            self.last_attended = self.attended_positions(self.trace_width())
        out = self.attend(q, position, scaling)
        return out.view(1, 1, *out.shape).to(query.dtype)

    def select(self, q: torch.Tensor, position: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(picks, chosen)``, both ``[Hkv, n_topk]``: the top tokens of each KV head by summed approximate
        probability, best first, and whether each pick is a real candidate (fewer candidates than ``n_topk``)."""
        # The candidates: after the sinks, before the local window.
        votes = pq_votes(q, self.centroids, self.code_rows, self.config.n_sink_tokens, position + 1 - self.n_local,
                         scaling)
        # Keys with the same codes tie; ties go to the earlier position, the same way on every device. A top-k
        # rather than a sort of all the tokens: only the first n_topk are kept.
        picks = stable_topk(votes, min(self.n_topk, self.capacity))
        return picks, votes.gather(1, picks) >= 0

    def _fetch(self, picks: torch.Tensor, chosen: torch.Tensor, position: torch.Tensor) -> None:
        """The chosen tokens' keys and values into the selection slots: from the block cache where it holds them,
        else from the host store; then the cache takes the step's most selected blocks."""
        if self.layer_idx in self.seq.state(PQCacheSequence).unjoined_updates:
            self._join_cache_updates()  # this layer's last update (no last layer has joined it: a lone layer)
        n_kv_heads, k = picks.shape
        heads = self._heads[:, None].expand(-1, k)
        blocks = picks // self.block_size
        if self.n_cache_blocks:
            cache_slot = self.block_slot.index_select(0, blocks.flatten()).view(n_kv_heads, k)
            hit = chosen & (cache_slot >= 0)
        else:
            hit = torch.zeros_like(chosen)
        miss = chosen & ~hit
        targets = torch.where(miss, self._picks[:k], -1)
        copy_blocks(self._token_keys, self._token_values, picks.flatten(), self.fetch_keys, self.fetch_values,
                    targets.flatten(), self._pick_heads)
        keys = self.fetch_keys[:k, :, 0].transpose(0, 1)  # [Hkv, k, D]
        values = self.fetch_values[:k, :, 0].transpose(0, 1)
        if self.n_cache_blocks:
            index = (cache_slot.clamp(min=0), heads, picks % self.block_size)
            keys = torch.where(hit[..., None], self.cache_keys[index], keys)
            values = torch.where(hit[..., None], self.cache_values[index], values)
        self.slot_keys[:, self.window : self.window + k] = keys
        self.slot_values[:, self.window : self.window + k] = values
        self.slot_positions[:, self.window : self.window + k] = torch.where(chosen, picks, -1)
        n_missed = miss.sum()
        row_bytes = 2 * self.model.head_dim * self.fetch_keys.element_size()
        self.seq.counters.record_on_device(pages_loaded=n_missed, bytes_to_gpu=n_missed * row_bytes)
        if self.n_cache_blocks:
            self._queue_cache_update(blocks, chosen, position)

    def _queue_cache_update(self, blocks: torch.Tensor, chosen: torch.Tensor, position: torch.Tensor) -> None:
        """The block-cache update, which only this layer's next fetch reads. On CUDA it runs on the sequence's cache
        stream beside the rest of the step, as PQCache overlaps it, and the model's last layer makes the model's
        stream wait for every update, so that a step, and a captured graph, ends with them done (a layer decoded
        alone joins its own at its next fetch). On the CPU it runs here."""
        item = self.fetch_keys.element_size()
        per_block = self.model.n_kv_heads * 2 * self.block_size * self.model.head_dim * item
        if not blocks.is_cuda:
            n_blocks = self._update_cache(blocks, chosen, position)
            self.seq.counters.record_on_device(pages_loaded=n_blocks * self.model.n_kv_heads,
                                               bytes_to_gpu=n_blocks * per_block)
            return
        shared = self.seq.state(PQCacheSequence)
        side = shared.cache_stream(blocks.device)
        side.wait_stream(torch.cuda.current_stream(blocks.device))
        with torch.cuda.stream(side):
            n_blocks = self._update_cache(blocks, chosen, position)
            counts = shared.cache_counts[blocks.device]
            counts[2] += n_blocks * self.model.n_kv_heads
            counts[3] += n_blocks * per_block
        for tensor in (blocks, chosen, position):  # read on the cache stream after the model's stream drops them
            tensor.record_stream(side)
        shared.unjoined_updates.add(self.layer_idx)
        if self.layer_idx == self.model.n_layers - 1:
            self._join_cache_updates()

    def _join_cache_updates(self) -> None:
        """The model's stream waits for the block-cache updates queued so far, and takes their counts."""
        shared = self.seq.state(PQCacheSequence)
        if not shared.unjoined_updates:
            return
        shared.unjoined_updates.clear()
        for device, side in shared.cache_streams.items():
            torch.cuda.current_stream(device).wait_stream(side)
            counts = shared.cache_counts[device]
            self.seq.counters.device_totals(device).add_(counts)
            counts.zero_()

    def _update_cache(self, blocks: torch.Tensor, chosen: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """LFU insertion of the ``cache_topk_blocks`` complete blocks with the most chosen tokens; returns how many
        blocks were copied in (a one-element tensor). Fixed shapes: entries with nothing to do go to the scratch
        block and slot."""
        n_blocks = self.block_slot.shape[0] - 1
        scratch_block, scratch_slot = n_blocks, self.n_cache_blocks
        counts = torch.zeros(n_blocks + 1, device=blocks.device)
        counts.scatter_add_(0, torch.where(chosen, blocks, scratch_block).flatten(), chosen.flatten().float())
        complete = self._block_ends <= position + 1  # every token of the block is in the store
        counts = torch.where(complete, counts[:n_blocks], 0.0)
        n_offered = min(self.config.cache_topk_blocks, n_blocks)
        offered = stable_topk(counts[None], n_offered)[0]  # ties to the lower block, on every device
        wanted = counts.gather(0, offered) > 0
        offered_slot = self.block_slot.index_select(0, offered)
        hit = wanted & (offered_slot >= 0)
        missing = wanted & (offered_slot < 0)
        # Victims: empty slots first, then the lowest use count, the oldest among equals; never a slot of this step.
        slots = self.slot_block[: self.n_cache_blocks]
        order_key = torch.where(slots < 0, -1, (self.slot_uses[: self.n_cache_blocks] << 32)
                                + self.slot_stamp[: self.n_cache_blocks])
        held = torch.zeros(self.n_cache_blocks + 1, dtype=torch.bool, device=blocks.device)
        # index_fill_ takes its value as a kernel argument: a Python value assigned by indexing would be copied from
        # host memory, which a captured step cannot do.
        held.index_fill_(0, torch.where(hit, offered_slot, scratch_slot), True)
        order = order_key.masked_fill(held[: self.n_cache_blocks], _HELD).argsort(stable=True)
        rank = (missing.long().cumsum(0) - 1).clamp(min=0)
        victims = torch.where(missing, order.gather(0, rank), scratch_slot)
        evicted = self.slot_block.index_select(0, victims)
        self.block_slot.index_fill_(0, torch.where(missing & (evicted >= 0), evicted, scratch_block), -1)
        self.block_slot[torch.where(missing, offered, scratch_block)] = victims
        self.slot_block[victims] = torch.where(missing, offered, -1)
        # Whole numbers, so the adds' order does not matter; a scatter_add_ is one kernel where an accumulating
        # index_put_ sorts its indices first.
        self.slot_uses.scatter_add_(0, torch.where(hit, offered_slot, scratch_slot), hit.long())
        self.slot_uses[victims] = missing.long()
        touched = torch.where(hit, offered_slot, victims)
        self.slot_stamp[touched] = position.expand_as(touched)
        n_heads = self.model.n_kv_heads
        shape = (offered.shape[0], n_heads)
        copy_blocks(self._block_keys, self._block_values, offered[:, None].expand(shape).flatten(), self.cache_keys,
                    self.cache_values, torch.where(missing, victims, -1)[:, None].expand(shape).flatten(),
                    self._offer_heads, programs=self.config.cache_copy_programs or None)
        return missing.sum()

    def gpu_kv_bytes(self) -> int:
        if self.slot_keys is None or self.slot_keys.device.type != "cuda":
            return super().gpu_kv_bytes()
        return sum(t.nbytes for t in (self.slot_keys, self.slot_values, self.cache_keys, self.cache_values,
                                      self.code_rows, self.centroids, self.fetch_keys, self.fetch_values))

    def cpu_kv_bytes(self) -> int:
        return 0 if not self.capacity else self.host_keys.nbytes + self.host_values.nbytes


# Where a CUDA model's prompt k-means runs (``PQCacheConfig.kmeans_on``): each queues a layer's host-store fill and
# clustering and returns what its first decode step waits for.
KMEANS_PLACES = {"host": PQCacheKV._cluster_on_host, "device": PQCacheKV._cluster_on_device}


@METHODS.register("pqcache")
class PQCache(Method):
    display_name = "PQCache"
    display_order = 90
    paper_names = ("PQC",)
    config_class = PQCacheConfig
    traces_in_graph = True
    speed_goals = (
        SpeedGoal(32768, "tpot", 3.0, "its block cache updated beside the step, its picks' top-k on the GPU"),
        SpeedGoal(32768, "tt2t", 4.0, "its k-means off the critical path (its paper: TT2T 13.3 s at 36k on an H100)"),
        *prompt_offload_goals("the prompt's KV copied to the host beside the next layers' prefill"),
    )
    # Small parts for 300-token prompts at budget 64: 4 sinks, 30 local, 30 selected; blocks of 8 in a 4-block cache.
    test_settings = {"n_sink_tokens": 4, "cache_block_size": 8, "cache_tokens": 32, "cache_topk_blocks": 4}

    def check(self) -> None:
        super().check()
        c = self.config
        if c.n_subspaces < 1 or self.model.head_dim % c.n_subspaces:
            raise ConfigError(f"pqcache: n_subspaces={c.n_subspaces} must divide head_dim={self.model.head_dim}")
        if not 1 <= c.n_bits <= 16:
            raise ConfigError(f"pqcache: n_bits={c.n_bits} must lie in [1, 16]")
        if c.kmeans_on not in KMEANS_PLACES:
            raise ConfigError(f"pqcache: kmeans_on={c.kmeans_on!r} must be one of {sorted(KMEANS_PLACES)}")
        if c.cache_copy_programs < 0:
            raise ConfigError(f"pqcache: cache_copy_programs={c.cache_copy_programs} must be >= 0 (0: one program "
                              f"per copied block and KV head)")
        if c.kmeans_iters < 0 or c.n_sink_tokens < 0:
            raise ConfigError(f"pqcache: kmeans_iters={c.kmeans_iters} and n_sink_tokens={c.n_sink_tokens} must "
                              f"be >= 0")
        if not 0 < c.local_ratio < 1:
            raise ConfigError(f"pqcache: local_ratio={c.local_ratio} must lie strictly between 0 and 1")
        if c.cache_block_size < 1 or c.cache_tokens < 0 or c.cache_tokens % c.cache_block_size:
            raise ConfigError(f"pqcache: cache_tokens={c.cache_tokens} must be a multiple of cache_block_size="
                              f"{c.cache_block_size} (>= 1)")
        n_cache_blocks = c.cache_tokens // c.cache_block_size
        if n_cache_blocks and not 1 <= c.cache_topk_blocks <= n_cache_blocks:
            raise ConfigError(f"pqcache: cache_topk_blocks={c.cache_topk_blocks} must lie in [1, {n_cache_blocks}] "
                              f"(the blocks the cache holds)")

    def forced_positions(self, n_tokens):
        c = self.config
        n_local, _ = budget_split(c)
        sinks = list(range(min(c.n_sink_tokens, n_tokens)))
        return sinks + list(range(max(len(sinks), n_tokens - n_local), n_tokens))

    def make_sparse_layer(self, layer_idx, seq):
        return PQCacheKV(layer_idx, self.model, seq, self.config)
