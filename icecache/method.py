"""IceCache (ICLR 2026): KV pages offloaded to CPU memory, chosen per decode step by a multi-level DCI index.

Per sparsified layer and KV head the prompt is split into sink pages (the first tokens), a recent window and the
middle. Prefill attends densely; then the middle tokens are indexed into one DCI tree per KV head (MIPS
transform, pages = B+-tree leaves of 8-16 tokens) on a CPU worker thread, while the GPU goes on with the next
layer, and the middle pages live in CPU (pinned) memory. Only the sink and window pages stay on the GPU, in a
page pool sized by the budget. At each decode step:

1. the layer's query goes to the CPU and each query head searches its KV head's tree for the K best pages;
2. the query heads of a KV group are merged rank by rank into K distinct pages;
3. the selection is diffed against the pages already in the GPU slots (kept pages stay unless their content
   changed since they were loaded);
4. the missing pages are gathered into one pinned buffer, copied to the GPU in one transfer and scattered into
   the freed slots (``icecache.core.paged.BulkLoader``);
5. attention runs over sinks + selected pages + window with per-page valid-token counts.

When the window is full, its oldest page is offloaded: inserted into the tree as a batch (pages split and
change; changed pages are rewritten in the CPU store and reloaded if resident).

IceCache-reuse (``n_reuse_layers = R``) lets the first layer of each group of R consecutive sparsified layers
own the index and the selection; the other layers lay out their own keys and values with the owner's pages and
load the owner's selection.

Choices where the two public code versions differ (ALGORITHMS.md 2.2): we follow v4434: all middle pages are
offloaded at prefill, batch insertion of a full window page, anchors (60, 60, 1.02), CPU KV in the model's dtype
by default (bf16 on GPU; ``cpu_kv_dtype=float32`` gives the main branch's float32 store). Budget (DESIGN.md):
``budget // page_size`` pages per head in all, of which ``n_sink_pages`` + ``n_window_pages`` are fixed and
K = the rest are selected. A prompt that fits in the budget is attended densely, as in the reference code.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from icecache.core.attention import paged_decode_attention
from icecache.core.errors import ConfigError
from icecache.core.method import METHODS, DenseKV, Method, MethodConfig, ModelInfo, SequenceContext  # noqa: F401
from icecache.core.paged import BulkLoader, CpuPageStore, GpuPagePool

DCI_LEAF_CAPACITY = 16
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class IceCacheConfig(MethodConfig):
    name: str = "icecache"
    budget: int | None = 256
    page_size: int = 16  # must equal the DCI leaf capacity
    n_sink_pages: int = 2
    n_window_pages: int = 2
    n_dense_layers: int = 2
    n_reuse_layers: int = 1  # 1: every layer owns its index; R > 1: IceCache-reuse
    promotion_prob: float = 0.01
    promotion_prob_subseq: float = 0.2
    build_field_of_view: int = 30
    build_prop_to_retrieve: float = 1.0
    anchor_interval: int = 60
    anchor_neighbours: int = 60
    anchor_threshold: float = 1.02
    insert_field_of_view: int = 20
    insert_prop_to_retrieve: float = 0.6
    query_field_of_view: int | None = None  # None: max(int(1.5e-3 * tokens), 30)
    query_prop_to_retrieve: float = 0.8
    cpu_threads: int | None = None  # OpenMP threads of the index (None: all cores)
    cpu_kv_dtype: str = "auto"  # auto (the model's dtype) | float32 | bfloat16
    offload_short_prompts: bool = False  # index even prompts that fit in the budget (tests, analysis)
    seed: int = 0


@METHODS.register("icecache")
class IceCache(Method):
    config_class = IceCacheConfig

    @property
    def page_budget(self) -> int:
        return self.config.budget // self.config.page_size

    @property
    def gpu_tokens(self) -> int:
        """Tokens the budget's GPU pages hold; a sequence no longer than this is attended densely."""
        return self.page_budget * self.config.page_size

    @property
    def n_selected_pages(self) -> int:
        return self.page_budget - self.config.n_sink_pages - self.config.n_window_pages

    def check(self) -> None:
        super().check()
        cfg = self.config
        if cfg.page_size != DCI_LEAF_CAPACITY:
            raise ConfigError(f"icecache page_size must be {DCI_LEAF_CAPACITY} (the DCI leaf capacity), not {cfg.page_size}")
        if cfg.n_sink_pages < 0 or cfg.n_window_pages < 1:
            raise ConfigError("icecache needs n_sink_pages >= 0 and n_window_pages >= 1")
        if self.n_selected_pages < 1:
            raise ConfigError(
                f"budget {cfg.budget} gives {self.page_budget} pages of {cfg.page_size} tokens, but n_sink_pages "
                f"({cfg.n_sink_pages}) + n_window_pages ({cfg.n_window_pages}) + 1 selected page need "
                f"{(cfg.n_sink_pages + cfg.n_window_pages + 1) * cfg.page_size}: raise the budget or lower them"
            )
        if cfg.n_reuse_layers < 1:
            raise ConfigError("n_reuse_layers must be >= 1 (1 = no reuse)")
        if cfg.cpu_kv_dtype != "auto" and cfg.cpu_kv_dtype not in _DTYPES:
            raise ConfigError(f"cpu_kv_dtype={cfg.cpu_kv_dtype}: use auto, {', '.join(_DTYPES)}")

    def owner_of(self, layer_idx: int) -> int:
        """The layer whose index and selection ``layer_idx`` uses (itself unless reused)."""
        position = layer_idx - self.config.n_dense_layers
        return layer_idx - position % self.config.n_reuse_layers

    def make_sparse_layer(self, layer_idx: int, seq: SequenceContext):
        return IceCacheLayer(layer_idx, self.model, seq, self)


@dataclass
class IceCacheReuseConfig(IceCacheConfig):
    name: str = "icecache_reuse"
    n_reuse_layers: int = 3


@METHODS.register("icecache_reuse")
class IceCacheReuse(IceCache):
    """IceCache(r): one index and selection per group of ``n_reuse_layers`` consecutive layers (default 3)."""

    config_class = IceCacheReuseConfig


class IceCacheLayer(DenseKV):
    """One sparsified layer: dense until offloaded, then sinks + DCI-selected pages + window on the GPU."""

    def __init__(self, layer_idx: int, model: ModelInfo, seq: SequenceContext, method: IceCache):
        super().__init__(layer_idx, model, seq)
        self.method = method
        self.cfg: IceCacheConfig = method.config
        self.is_owner = method.owner_of(layer_idx) == layer_idx
        self.offloaded = False
        self._ready: Future | None = None

    # ------------------------------------------------------------------ shared per-sequence state
    def _shared(self, owner: int | None = None) -> dict[str, Any]:
        owner = self.method.owner_of(self.layer_idx) if owner is None else owner
        return self.seq.shared.setdefault(("icecache", owner), {})

    def _worker(self) -> ThreadPoolExecutor:
        # One worker per sequence: jobs run in layer order, so an owner's index is built before its reusers read it.
        worker = self.seq.shared.get("icecache_worker")
        if worker is None:
            worker = self.seq.shared["icecache_worker"] = ThreadPoolExecutor(1, thread_name_prefix="icecache-index")
        return worker

    # ------------------------------------------------------------------ prefill and offload
    def prefill(self, query, key, value, attention_mask, scaling):
        if query.shape[0] != 1:
            raise ValueError("icecache runs batch size 1")
        out = super().prefill(query, key, value, attention_mask, scaling)
        over_budget = self.length > self.method.gpu_tokens
        if not self.seq.more_prefill_chunks and (over_budget or self.cfg.offload_short_prompts):
            self._offload_prompt()
        return out

    def _offload_prompt(self) -> None:
        cfg, ps = self.cfg, self.cfg.page_size
        keys, values = self.keys[0], self.values[0]  # [Hkv, T, D]
        total = keys.shape[1]
        sink_len = min(cfg.n_sink_pages * ps, total)
        tail = total % ps
        window_len = (cfg.n_window_pages - 1) * ps + tail if tail else cfg.n_window_pages * ps
        window_len = min(window_len, total - sink_len)
        middle_end = total - window_len
        device, dtype = keys.device, keys.dtype
        n_kv_heads, head_dim = self.model.n_kv_heads, self.model.head_dim
        k_sel = self.method.n_selected_pages
        self.sink_slots = -(-sink_len // ps)
        self.window_slot0 = cfg.n_sink_pages + k_sel
        self.pool = GpuPagePool(self.method.page_budget, n_kv_heads, ps, head_dim, dtype, device)
        for page in range(self.sink_slots):
            chunk = slice(page * ps, min((page + 1) * ps, sink_len))
            n = chunk.stop - chunk.start
            self.pool.key_pages[page, :, :n] = keys[:, chunk]
            self.pool.value_pages[page, :, :n] = values[:, chunk]
        self.sink_len = sink_len
        self.window_count = 0
        self.window_start = middle_end  # absolute position of the window's first token
        self._write_window(keys[:, middle_end:], values[:, middle_end:])
        self.resident = np.full((n_kv_heads, k_sel), -1, dtype=np.int64)  # page id held by each selected slot
        self.stale = np.zeros((n_kv_heads, 0), dtype=bool)  # page content changed since it was loaded
        cpu_dtype = dtype if cfg.cpu_kv_dtype == "auto" else _DTYPES[cfg.cpu_kv_dtype]
        pin = device.type == "cuda"
        self.store = CpuPageStore(n_kv_heads, ps, head_dim, cpu_dtype, pin_memory=pin)
        self.loader = BulkLoader(ps, head_dim, cpu_dtype, device, max_pages=n_kv_heads * k_sel)
        # Token store by offloaded-token id (the DCI's ids); pages are rewritten from it when they change.
        self.token_keys = torch.empty(n_kv_heads, 0, head_dim, dtype=cpu_dtype)
        self.token_values = torch.empty_like(self.token_keys)
        self.token_positions = np.arange(sink_len, middle_end)
        middle_k = keys[:, sink_len:middle_end].to("cpu", cpu_dtype, non_blocking=pin)
        middle_v = values[:, sink_len:middle_end].to("cpu", cpu_dtype, non_blocking=pin)
        copied = torch.cuda.Event() if pin else None
        if copied is not None:
            copied.record()
        self._keys = self._values = None  # the full prompt leaves the GPU
        self.offloaded = True
        self._ready = self._worker().submit(self._index_prompt, middle_k, middle_v, copied)
        self.seq.shared.setdefault("icecache_jobs", []).append(self._ready)

    @torch.inference_mode()  # inference mode is per thread; the store's tensors were made under it
    def _index_prompt(self, middle_k: torch.Tensor, middle_v: torch.Tensor, copied) -> None:
        if copied is not None:
            copied.synchronize()
        self.token_keys, self.token_values = middle_k, middle_v
        shared = self._shared()
        if self.is_owner:
            cfg = self.cfg
            from icecache.dci import DCIIndex

            index = DCIIndex(
                self.model.head_dim, self.model.n_kv_heads, promotion_prob=cfg.promotion_prob,
                promotion_prob_subseq=cfg.promotion_prob_subseq, transform=True, deterministic_levels=True,
                seed=cfg.seed, num_threads=cfg.cpu_threads,
            )
            if middle_k.shape[1]:
                index.build(
                    middle_k.float().numpy(), field_of_view=cfg.build_field_of_view,
                    prop_to_retrieve=cfg.build_prop_to_retrieve, anchor_interval=cfg.anchor_interval,
                    anchor_neighbours=cfg.anchor_neighbours, anchor_threshold=cfg.anchor_threshold,
                )
            shared["index"] = index
            shared["changed"] = index.pop_changed_pages() if middle_k.shape[1] else None
        self._rewrite_pages(shared["changed"])
        self._progress().update()

    def _progress(self):
        """One bar per sequence over the sparsified layers' prompt indexing (shown on a terminal only)."""
        bar = self.seq.shared.get("icecache_progress")
        if bar is None:
            from tqdm.auto import tqdm

            n_layers = self.model.n_layers - self.cfg.n_dense_layers
            bar = self.seq.shared["icecache_progress"] = tqdm(
                total=n_layers, desc="indexing prompt", unit="layer", leave=False, disable=None
            )
        return bar

    def _rewrite_pages(self, changed: np.ndarray | None) -> None:
        """Lay out the pages flagged in ``changed [Hkv, pages]`` from the token store (the owner's page map)."""
        if changed is None or not changed.any():
            return
        index = self._shared()["index"]
        page_ids, heads, rows = [], [], []
        for head in range(self.model.n_kv_heads):
            pages = np.flatnonzero(changed[head])
            if pages.size == 0:
                continue
            tokens = index.page_tokens(head)[pages]  # [n, 16], -1 padded
            page_ids.append(pages)
            heads.append(np.full(pages.size, head))
            rows.append(tokens)
        page_ids_t = torch.from_numpy(np.concatenate(page_ids))
        heads_t = torch.from_numpy(np.concatenate(heads))
        tokens_t = torch.from_numpy(np.concatenate(rows)).long()
        valid = tokens_t >= 0
        gather = tokens_t.clamp(min=0)
        keys = self.token_keys[heads_t[:, None], gather] * valid[..., None]
        values = self.token_values[heads_t[:, None], gather] * valid[..., None]
        self.store.write_pages(page_ids_t, heads_t, keys, values)
        n_pages = changed.shape[1]
        if self.stale.shape[1] < n_pages:
            self.stale = np.pad(self.stale, ((0, 0), (0, n_pages - self.stale.shape[1])))
        self.stale[:, :n_pages] |= changed

    # ------------------------------------------------------------------ the window
    def _write_window(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append tokens ``[Hkv, n, D]`` to the window pages (the caller makes room first)."""
        ps = self.cfg.page_size
        for i in range(keys.shape[1]):
            slot = self.window_slot0 + self.window_count // ps
            self.pool.key_pages[slot, :, self.window_count % ps] = keys[:, i]
            self.pool.value_pages[slot, :, self.window_count % ps] = values[:, i]
            self.window_count += 1

    def _evict_oldest_window_page(self) -> None:
        ps, first = self.cfg.page_size, self.window_slot0
        page_k = self.pool.key_pages[first].clone()
        page_v = self.pool.value_pages[first].clone()
        last = first + self.cfg.n_window_pages
        self.pool.key_pages[first : last - 1] = self.pool.key_pages[first + 1 : last].clone()
        self.pool.value_pages[first : last - 1] = self.pool.value_pages[first + 1 : last].clone()
        self.window_count -= ps
        positions = np.arange(self.window_start, self.window_start + ps)
        self.window_start += ps
        with self.seq.timer.phase("insert"):
            # Every layer's prompt job must be done before the owner's index changes under the reusers' feet.
            for job in self.seq.shared["icecache_jobs"]:
                job.result()
            cpu_k = page_k.to("cpu", self.store.dtype)
            cpu_v = page_v.to("cpu", self.store.dtype)
            self.token_keys = torch.cat([self.token_keys, cpu_k], dim=1)
            self.token_values = torch.cat([self.token_values, cpu_v], dim=1)
            self.token_positions = np.concatenate([self.token_positions, positions])
            shared = self._shared()
            if self.is_owner:
                cfg = self.cfg
                shared["index"].insert(
                    cpu_k.float().numpy(), field_of_view=cfg.insert_field_of_view,
                    prop_to_retrieve=cfg.insert_prop_to_retrieve, as_batch=True,
                )
                shared["changed"] = shared["index"].pop_changed_pages()
            self._rewrite_pages(shared["changed"])

    # ------------------------------------------------------------------ decode
    def decode(self, query, key, value, scaling):
        if not self.offloaded:
            if self.length + 1 <= self.method.gpu_tokens:
                out = super().decode(query, key, value, scaling)
                self.seq.counters.record_attention(self.length)
                return out
            self._offload_prompt()
        if self.window_count == self.cfg.n_window_pages * self.cfg.page_size:
            self._evict_oldest_window_page()
        self._write_window(key[0], value[0])
        self._ready.result()
        selection = self._select(query[0, :, 0, :])
        with self.seq.timer.phase("load"):
            self._load(selection)
        page_table, valid_counts = self._page_table()
        attended = valid_counts.sum(dim=1).float().mean().item()
        self.seq.counters.record_attention(attended)
        if self.seq.trace_selection:
            self.last_attended = self._attended_positions()
        out = paged_decode_attention(
            query[0, :, 0, :], self.pool.key_pages, self.pool.value_pages, page_table, valid_counts, scaling
        )
        return out[None, None]

    def _select(self, query: torch.Tensor) -> np.ndarray:
        """K distinct pages per KV head ``[Hkv, K]`` (-1 padded): the owner searches, reusers read its choice."""
        shared = self._shared()
        if not self.is_owner:
            return shared["selection"]
        k_sel = self.method.n_selected_pages
        index = shared["index"]
        if index.num_tokens == 0:
            shared["selection"] = np.full((self.model.n_kv_heads, k_sel), -1, dtype=np.int64)
            return shared["selection"]
        with self.seq.timer.phase("query"):
            pages, _ = index.query(
                query.float().cpu().numpy(), k_sel, field_of_view=self.cfg.query_field_of_view,
                prop_to_retrieve=self.cfg.query_prop_to_retrieve, ratio=self.model.group_size,
            )
            shared["selection"] = merge_group_pages(pages, self.model.group_size, k_sel)
        return shared["selection"]

    def _load(self, selection: np.ndarray) -> None:
        slots_out, pages_out, heads_out = diff_selection(self.resident, self.stale, selection)
        if not pages_out:
            return
        pages_t = torch.tensor(pages_out)
        heads_t = torch.tensor(heads_out)
        self.stale[heads_t.numpy(), pages_t.numpy()] = False
        slots_t = torch.tensor(slots_out) + self.cfg.n_sink_pages
        moved = self.loader.load(self.store, pages_t, heads_t, self.pool, slots_t)
        self.seq.counters.pages_loaded += len(pages_out)
        self.seq.counters.bytes_to_gpu += moved

    def _page_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, ps = self.cfg, self.cfg.page_size
        n_kv_heads, k_sel = self.model.n_kv_heads, self.method.n_selected_pages
        counts = self._shared()["index"].page_valid_counts()
        selected_counts = np.zeros((n_kv_heads, k_sel), dtype=np.int64)
        held = self.resident >= 0
        heads = np.nonzero(held)[0]
        selected_counts[held] = counts[heads, self.resident[held]]
        sink_counts = [min(ps, self.sink_len - p * ps) for p in range(cfg.n_sink_pages)]
        n_window_pages = -(-self.window_count // ps)
        window_counts = [
            min(ps, self.window_count - p * ps) if p < n_window_pages else 0 for p in range(cfg.n_window_pages)
        ]
        row = list(range(self.method.page_budget))
        table = np.tile(np.array(row), (n_kv_heads, 1))
        valid = np.concatenate(
            [np.tile(np.maximum(sink_counts, 0), (n_kv_heads, 1)), selected_counts,
             np.tile(window_counts, (n_kv_heads, 1))], axis=1,
        )
        table[valid == 0] = -1
        device = self.pool.key_pages.device
        return torch.from_numpy(table).to(device), torch.from_numpy(valid).to(device, torch.int32)

    def _attended_positions(self) -> torch.Tensor:
        """bool [Hq, seq_len + 1] of the positions each query head attends (trace_selection)."""
        total = self.seq_len + 1
        index = self._shared()["index"]
        mask = torch.zeros(self.model.n_kv_heads, total, dtype=torch.bool, device=self.pool.key_pages.device)
        mask[:, : self.sink_len] = True
        mask[:, self.window_start : total] = True
        for head in range(self.model.n_kv_heads):
            pages = self.resident[head][self.resident[head] >= 0]
            if pages.size:
                tokens = index.page_tokens(head)[pages].reshape(-1)
                mask[head, self.token_positions[tokens[tokens >= 0]]] = True
        return mask.repeat_interleave(self.model.group_size, dim=0)

    def gpu_kv_bytes(self) -> int:
        if not self.offloaded:
            return super().gpu_kv_bytes()
        return self.pool.nbytes() if self.pool.key_pages.is_cuda else 0

    def cpu_kv_bytes(self) -> int:
        if not self.offloaded:
            return 0
        return self.store.nbytes() + self.token_keys.nbytes + self.token_values.nbytes


def merge_group_pages(pages: np.ndarray, group_size: int, k: int) -> np.ndarray:
    """Per KV head, interleave its query heads' ranked page lists rank by rank; keep the first ``k`` distinct.

    ``pages [Hq, K]`` (-1 padded) -> ``[Hkv, k]`` (-1 padded).
    """
    n_kv_heads = pages.shape[0] // group_size
    merged = np.full((n_kv_heads, k), -1, dtype=np.int64)
    for head in range(n_kv_heads):
        ranked = pages[head * group_size : (head + 1) * group_size].T.reshape(-1)  # rank-major
        ranked = ranked[ranked >= 0]
        _, first_seen = np.unique(ranked, return_index=True)
        distinct = ranked[np.sort(first_seen)][:k]
        merged[head, : distinct.size] = distinct
    return merged


def diff_selection(
    resident: np.ndarray, stale: np.ndarray, selection: np.ndarray
) -> tuple[list[int], list[int], list[int]]:
    """Update ``resident [Hkv, K]`` (page per slot) in place to hold ``selection [Hkv, K]``.

    Pages still selected and not stale keep their slot; the others are loaded into freed slots. Returns the
    (slot, page, head) triples to load. Slots that end up unused hold -1.
    """
    slots_out, pages_out, heads_out = [], [], []
    for head in range(resident.shape[0]):
        wanted = [int(p) for p in selection[head] if p >= 0]
        wanted_set = set(wanted)
        keep = {
            int(p) for p in resident[head]
            if p >= 0 and p in wanted_set and not (p < stale.shape[1] and stale[head, p])
        }
        free = [s for s, p in enumerate(resident[head]) if p < 0 or int(p) not in keep]
        to_load = [p for p in wanted if p not in keep]
        for slot in free:
            resident[head, slot] = -1
        for slot, page in zip(free, to_load):
            resident[head, slot] = page
            slots_out.append(slot)
            pages_out.append(page)
            heads_out.append(head)
    return slots_out, pages_out, heads_out
