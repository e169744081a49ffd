"""IceCache (ICLR 2026): KV pages offloaded to CPU memory, chosen per decode step by a multi-level DCI index.

Per sparsified layer and KV head the prompt is split into sink pages (the first tokens), a recent window and the
middle. Prefill attends densely; then the middle tokens are indexed into one DCI tree per KV head (MIPS
transform, pages = B+-tree leaves of 8-16 tokens) by CPU worker threads, while the GPU goes on with the next
layers, and the middle tokens live in CPU memory once: the keys in the index (in the cache's dtype, scored in
place), the values in the layer's token store, both by token id. Only the sink and window pages stay on the GPU, in a
page pool sized by the budget. At each decode step:

1. the layer's query goes to the CPU and each query head searches its KV head's tree for the K best pages;
2. the query heads of a KV group are merged rank by rank into K distinct pages;
3. the selection is diffed against the pages already in the GPU slots (kept pages stay unless their content
   changed since they were loaded);
4. the missing pages' rows are gathered by token id into one pinned buffer, copied to the GPU in one transfer
   and scattered into the freed slots (``icecache.core.paged.StepTransit``);
5. attention runs over sinks + selected pages + window with per-page valid-token counts.

When the window is full, its oldest page is offloaded (from the window's host copy): inserted into the tree as a
batch (pages split and change; changed pages are reloaded if resident).

With ``cuda_graph`` (on by default; it only acts on CUDA) the decode step, host work included, is captured
in one CUDA graph: each layer's host work runs as a host function of the graph, so the transformer's kernels are
launched by the graph
rather than one by one from Python. The dense layers then keep their cache in static buffers
(``core.static_kv.StaticDenseKV``) so that they can be captured too.

IceCache-reuse (``n_reuse_layers = R``) lets the first layer of each group of R consecutive sparsified layers
own the index and the selection; the other layers keep their own keys and values and load the owner's selection,
gathered from their own tensors through the owner's pages.

Choices where the two public code versions differ (docs/algorithms.md, IceCache): we follow v4434: all middle pages are
offloaded at prefill, batch insertion of a full window page, anchors (60, 60, 1.02), CPU KV in the model's dtype
by default (bf16 on GPU; ``cpu_kv_dtype=float32`` gives the main branch's float32 store). Budget
(docs/design.md, Budget semantics): ``budget // page_size`` pages per head in all, of which ``n_sink_pages`` +
``n_window_pages`` are fixed and K = the rest are selected; at budgets the fixed pages would fill, they shrink to
one page each (``IceCacheConfig.fitted_to_budget``). A prompt that fits in the budget is attended densely, as in
the reference code.

The package:

    config.py     the settings and how the budget divides into pages
    method.py     the registered methods (icecache, icecache_reuse): checks, page counts, the owner of a layer
    layer.py      one sparsified layer: prefill and offload, the prompt job, the window, the decode step
    lookahead.py  the opt-in look-ahead search (lookahead=true): a speculative query, its check, its correction
    selection.py  merging a GQA group's ranked pages, and diffing a selection against the resident pages
    state.py      what a sequence's layers share (the index and selection of a reuse group, the prompt worker)
    stores.py     the host-memory token store
"""

from .config import DCI_LEAF_CAPACITY, IceCacheConfig, IceCacheReuseConfig
from .layer import IceCacheLayer
from .method import IceCache, IceCacheReuse
from .selection import diff_selection, merge_group_pages
from .state import GroupState, IceCacheSequence
from .stores import TokenStore

__all__ = [
    "DCI_LEAF_CAPACITY", "GroupState", "IceCache", "IceCacheConfig", "IceCacheLayer", "IceCacheReuse",
    "IceCacheReuseConfig", "IceCacheSequence", "TokenStore", "diff_selection", "merge_group_pages",
]
