"""MagicPIG (Chen et al., ICLR 2025): attention estimated from keys sampled by locality-sensitive hashing, with
importance weights, the sampled part computed on the CPU.

The paper. Attention is not sparse enough for TopK to be unbiased, so MagicPIG samples keys instead and
reweights them. Each key, centred by the mean of the prompt's keys, gets ``L`` SimHash codes of ``K`` bits (the
signs of ``K`` random projections per table); a query is hashed the same way, and a key is sampled when it falls
in the query's bucket in at least two of the ``L`` tables. The chance of that for a key at angle ``theta`` to the
query is ``u = 1 - (1 - p)^L - L p (1 - p)^(L - 1)`` with ``p = (1 - theta / pi)^K``, so the sampled keys are
weighted by ``1 / u`` (self-normalised importance sampling): the estimate of a head's output is
``sum_S exp(s_i) / u_i v_i / sum_S exp(s_i) / u_i`` over the sampled set ``S``, ``s_i = q . k_i / sqrt(d)``.
The GPU holds the first tokens (sinks) and a local window and attends to them exactly; the hash tables, the
offloaded keys and values and the sampled attention live on the CPU; the two partial softmaxes are merged by their
log-sum-exp. The paper's configurations are ``K = 10, L = 150`` and ``K = 11, L = 300``, stated by their
computation cost (the share of full attention's work, about 2% for both), not by a number of tokens.

This code. The prompt is attended densely; after its last chunk each sparsified layer keeps 4 sink tokens and a window
of 64 (the public code's ``num_sink_tokens`` and ``num_local_tokens``) in device buffers and copies every token to host
memory, with the norm of its centred key. The device hashes the middle of the prompt (after the sinks) with one set of
``K * L`` Gaussian projections (the same for every layer, seeded) and sorts each table by bucket, on CUDA on a side
stream beside the next layers' prefill (``MagicPIGSequence``); the host keeps the tables (``HashTables``: per KV head
and table, the tokens in bucket order and each bucket's span). The host store and tables are buffers of the core's host
pool (``core.host_memory``: pinned on CUDA, kept from one sequence to the next), filled on a side stream beside the next
layers' prefill. A decode step writes the new token into the window ring (slot ``4 + (t - 4) % 64``; the token it
overwrites is in host memory already and joins the middle), hashes the query and the new key on the device (phase
``hash``), and sends them to the host with the new key and value in one fixed-size copy
(``core.host_step.HostExchange``). The host's part is one C++ call with the GIL released
(``icecache/core/kernels/src/magicpig_host.cpp``, ``_magicpig_host.HostStep``, on buffers Python allocates once and the
C++ step reads in place): it stores the token (key and value in the store's dtype, the norm of its centred key, its
codes), counts for each query head the tables in which each middle token shares its bucket (the prompt's through the
tables, later tokens directly), samples the tokens with at least two collisions and weighs them (phase ``select``; the
angle's chance in float64), and computes their attention with the log-weights ``-log(u + 1e-4)`` (the public code's
floor) and its log-sum-exp (phase ``cpu_attention``), the query heads spread over torch's CPU threads (OpenMP); the
device attends the sinks and window, and merges the two parts. The step is captured in a CUDA graph on CUDA: the C++
call is a hand-off of the graph (``HostExchange.run_native``), as IceCache's step is; on a CPU it is called at once, so
the CPU tests run the code the GPU path runs. What the C++ step counted and timed is folded into the sequence after each
step (after each replay, ``between_steps``, which also grows the host store: the C++ step never resizes it).

Budget. ``budget`` slots per query head: the sinks, the window (the new token included) and at most ``budget -
n_sink_tokens - n_local_tokens`` sampled tokens; a budget the sinks and window would fill shrinks the window to a
quarter of what the sinks leave (4 + 15 + 45 at budget 64; the public code's 64 is a quarter of 256), and the run
records that setting. While the middle fits in the sampled slots, every middle token is attended with weight 1, so
attention is exact (a sequence that fits the budget is attended in full, as for every method). Beyond, the tokens the
hash tables sample are attended; if a head samples more than fit (``capped: true``), a uniformly random subset of them
of the allowed size is kept (those of the smallest draws, one uniform draw in [0, 1) per position shared by the
heads: the top 53 bits of splitmix64 chained over seed, layer, position and token, so the same on every device, thread
count and replay; it replaced draws of torch's CPU generator seeded per step, which C++ cannot reproduce) and the
weights of that head's kept tokens grow by the inverse of the fraction kept, so the estimator stays
importance-weighted. The number attended varies from step to step and head to head; runs record the mean
(``mean_attended_tokens``), the effective budget. ``capped: false`` runs the paper's uncapped sampling (the budget then
only decides when attention is exact) for comparisons with its tables.

With ``seq.trace_selection`` a layer records the positions each query head attended (``last_attended``) and, since
this is a weighted estimate rather than a softmax over a subset, the additive log-weight of each
(``last_log_weights``: 0 for sinks, window and exact attention): its output is the softmax of
``q . k / sqrt(d) + log_weight`` over the attended positions.

Differences from the paper's code: the first ``n_dense_layers`` layers (default 2) keep the full cache, where the public
code keeps layers 0 and 16 of Llama-3.1-8B dense; tokens generated after the prompt join the hash tables when they leave
the window (the public code keeps every generated token on the GPU); the tables are built when a layer's prompt is done
rather than beside the next layer's prefill; the CPU part is one C++ call in float32 arithmetic (rows of the bf16 store
widened as they are read, as the public code's AVX-512 kernels convert bf16 keys on the fly), its row kernels built
for the x86-64 baseline, AVX2 and AVX-512 and picked at load time; the cap above is ours (the paper has no token
budget). Rule tests (codes, table counts, the two-collision rule, the weights, thinning, the exact mode) and the C++
step against its torch definition (``tests/magicpig_reference.py``): ``tests/test_magicpig.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from icecache.core.host_memory import to_device_without_waiting
from icecache.core.host_step import HostExchange
from icecache.core.kernels import _magicpig_host
from icecache.core.kernels.sign_codes import sign_codes
from icecache.core.method import (
    METHODS,
    DenseKV,
    Method,
    MethodConfig,
    SpeedGoal,
    prompt_offload_goals,
    storage_capacity,
)
from icecache.errors import ConfigError

# A key is sampled when it shares the query's bucket in at least this many tables (the public code's rule).
MIN_COLLISIONS = 2
# The public code's floor in the log-weights, -log(u + 1e-4): a key sampled against the odds (u near 0) weighs at
# most 1e4 times a sure one.
WEIGHT_FLOOR = 1e-4
# Codes are int32 and each table keeps 2^K + 1 bucket offsets per KV head.
MAX_HASH_BITS = 16
# The prompt is hashed this many tokens at a time (the public code's chunk): at 128k tokens and K * L = 1500
# projections a layer's projections at once would take 6 GB.
HASH_BLOCK_TOKENS = 8192
# The dtypes the C++ host step stores tokens in, by the code it takes.
_STORE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass
class MagicPIGConfig(MethodConfig):
    name: str = "magicpig"
    K: int = 10  # bits per hash table (SimHash projections per table)
    L: int = 150  # hash tables
    n_sink_tokens: int = 4  # first tokens, attended exactly on the device
    n_local_tokens: int = 64  # the recent window on the device, the new token included
    capped: bool = True  # at most budget - sinks - window sampled tokens per head (false: the paper's uncapped)
    seed: int = 0  # hash projections and the thinning draws

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "MagicPIGConfig":
        return super().from_dict(values).fitted_to_budget()

    def min_budget(self) -> int:
        """The sinks, a window of one and one sampled slot (the window shrinks to fit, ``fitted_to_budget``)."""
        return self.n_sink_tokens + 2

    def min_budget_reason(self) -> str:
        return f"n_sink_tokens={self.n_sink_tokens} + a window of 1 + 1 sampled token"

    def fitted_to_budget(self) -> "MagicPIGConfig":
        """The settings MagicPIG runs with at this budget. Where the configured sinks and window leave no slot to
        sample (64 sinks-and-window tokens in a budget of 64), the window takes a quarter of what the sinks leave,
        the share of the public code's 64 in a budget of 256: 15 tokens at budget 64. Budgets with a slot to sample
        are untouched; the runner records the settings returned here."""
        budget = self.budget
        if not isinstance(budget, int) or isinstance(budget, bool) or self.n_sink_tokens < 0 or self.n_local_tokens < 1:
            return self
        if budget - self.n_sink_tokens - self.n_local_tokens >= 1:
            return self
        return dataclasses.replace(self, n_local_tokens=max(1, (budget - self.n_sink_tokens) // 4))


# --- the paper's definitions ---------------------------------------------------------------------------------------


def hash_projections(head_dim: int, K: int, L: int, seed: int) -> torch.Tensor:
    """``[head_dim, L * K]`` float32 Gaussian projections; table ``l`` uses columns ``l * K .. l * K + K - 1``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(head_dim, L * K, generator=generator)


def simhash_codes(vectors: torch.Tensor, projections: torch.Tensor, K: int) -> torch.Tensor:
    """``vectors [..., D]`` -> int32 ``[..., L]``: in table ``l``, bit ``j`` is set when the vector's projection
    on column ``l * K + j`` is positive (SimHash: the bucket of a direction, not of a length)."""
    return sign_codes(vectors.float() @ projections.to(vectors.device), K)


def collision_probability(cos_angle: torch.Tensor, K: int) -> torch.Tensor:
    """SimHash: two vectors at angle theta share a K-bit bucket with probability ``(1 - theta / pi)^K``."""
    theta = torch.arccos(cos_angle.clamp(-1.0, 1.0))
    return (1.0 - theta / math.pi) ** K


def sampling_probability(cos_angle: torch.Tensor, K: int, L: int) -> torch.Tensor:
    """The chance that a key collides with the query in at least two of ``L`` tables:
    ``1 - (1 - p)^L - L p (1 - p)^(L - 1)``, in float64 (in float32 the difference of terms near 1 loses the
    small chances that weigh most), returned as float32."""
    p = collision_probability(cos_angle.double(), K)
    miss = 1.0 - p
    return (1.0 - miss ** L - L * p * miss ** (L - 1)).float()


def collision_counts_reference(query_codes: torch.Tensor, key_codes: torch.Tensor, group: int) -> torch.Tensor:
    """``query_codes [Hq, L]`` against ``key_codes [Hkv, T, L]`` -> ``[Hq, T]``: in how many tables each key shares
    the query's bucket (query head ``h`` reads KV head ``h // group``)."""
    keys = key_codes.repeat_interleave(group, dim=0)
    return (keys == query_codes[:, None, :]).sum(-1)


class HashTables:
    """One layer's hash tables over a run of positions: per KV head and table the positions sorted by bucket
    (``positions [Hkv, L, T]``) and where each bucket starts (``offsets [Hkv, L, 2^K + 1]``), on the CPU.
    The host step reads both in place; ``counts`` gives what ``collision_counts_reference`` gives, reading only the
    query's buckets, as the host step counts."""

    def __init__(self, key_codes: torch.Tensor, first_position: int, K: int, prompt_copies=None,
                 host_copies: list | None = None):
        """Sorted where ``key_codes`` are. With ``prompt_copies`` (``core.host_memory.PromptCopies``) the two host
        arrays are buffers of its pool, and their fills ``(destination, source)`` are appended to ``host_copies``
        for the caller to queue; without, they are copied here."""
        n_kv_heads, n_tokens, n_tables = key_codes.shape
        # Codes of at most 14 bits are sorted as int16 (their buckets' bounds, up to 2^K, fit too): the same order
        # (a stable sort of the same values), and a radix sort over half the key bits.
        narrow = torch.int16 if K <= 14 else key_codes.dtype
        by_table = key_codes.transpose(1, 2).to(narrow).contiguous()  # [Hkv, L, T]
        sorted_codes, order = torch.sort(by_table, dim=-1, stable=True)
        buckets = torch.arange(2**K + 1, dtype=sorted_codes.dtype, device=key_codes.device)
        offsets = torch.searchsorted(sorted_codes, buckets.expand(n_kv_heads, n_tables, -1).contiguous())
        positions = (order + first_position).to(torch.int32)
        if prompt_copies is None:
            self.offsets = offsets.cpu().contiguous()  # int64, read in place by the host step
            self.positions = positions.cpu().contiguous()
        else:
            self.offsets = prompt_copies.take(tuple(offsets.shape), offsets.dtype, key_codes.device)
            self.positions = prompt_copies.take(tuple(positions.shape), torch.int32, key_codes.device)
            host_copies += [(self.offsets, offsets), (self.positions, positions)]
        self.n_tables = n_tables
        self.end = first_position + n_tokens  # the positions the tables hold are below this

    def counts(self, query_codes: torch.Tensor, group: int, n_positions: int) -> torch.Tensor:
        """``[Hq, n_positions]`` int64: collisions of each position below ``n_positions`` with each query head, as
        the host step counts them (``_magicpig_host.table_collision_counts``)."""
        counts = _magicpig_host.table_collision_counts(self.offsets.numpy(), self.positions.numpy(),
                                                       query_codes.cpu().numpy(), group, n_positions)
        return torch.from_numpy(counts)

    def nbytes(self) -> int:
        return self.positions.nbytes + self.offsets.nbytes


def grown_along(tensor: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """A zeroed copy of ``tensor`` with ``size`` entries along ``dim``, its own in front (how the host store
    grows)."""
    shape = list(tensor.shape)
    shape[dim] = size
    bigger = tensor.new_zeros(shape)
    bigger.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    return bigger


# --- the layer -----------------------------------------------------------------------------------------------------


class MagicPIGSequence:
    """What a sequence's MagicPIG layers share: on CUDA the side stream that hashes and sorts each layer's prompt,
    in layer order, beside the prefill of the later layers on the model's stream."""

    def __init__(self):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._projections: dict[tuple, torch.Tensor] = {}

    def projections(self, device: torch.device, head_dim: int, K: int, L: int, seed: int) -> torch.Tensor:
        """``hash_projections`` on ``device``, drawn once per sequence (every layer uses the same ones) and moved
        without a wait for the layer's queued prefill."""
        key = (device, head_dim, K, L, seed)
        if key not in self._projections:
            self._projections[key] = to_device_without_waiting(hash_projections(head_dim, K, L, seed), device)
        return self._projections[key]

    def hashing_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


class MagicPIGKV(DenseKV):
    """Sinks and window on the device (``n_sink_tokens + n_local_tokens`` slots, the window a ring); every token in
    host memory; the prompt's hash tables on the host; the sampled attention on the host."""

    def __init__(self, layer_idx, model, seq, config: MagicPIGConfig):
        super().__init__(layer_idx, model, seq)
        self.cfg = config
        self.n_sink, self.n_local = config.n_sink_tokens, config.n_local_tokens
        self.cap = config.budget - self.n_sink - self.n_local  # sampled tokens a head may attend
        self.group = model.n_heads // model.n_kv_heads
        self.offloaded = False
        self.native = None  # the C++ host step, made once the prompt is offloaded

    # --- prompt ----------------------------------------------------------------------------------------------------
    def prefill(self, query, key, value, attention_mask, scaling):
        if query.shape[0] != 1:
            raise ValueError("sparse KV methods run with batch size 1")
        out = super().prefill(query, key, value, attention_mask, scaling)
        if not self.seq.more_prefill_chunks:
            # The phase times the model stream's part; the copies to the host and the hashing run on side streams
            # beside the next layers' prefill (a phase waits for its own stream only).
            with self.seq.timer.phase("offload"):
                self._offload(self.keys[0], self.values[0])
            self._keys = self._values = None
            self.length = 0
        return out

    def _ring_slot(self, position: torch.Tensor) -> torch.Tensor:
        return torch.where(position < self.n_sink, position, self.n_sink + (position - self.n_sink) % self.n_local)

    def _offload(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The device's sinks and window, the host store (its fill queued on the prompt copies' stream), the hash
        tables and the native step."""
        cfg, device = self.cfg, keys.device
        n_kv_heads, n_tokens, head_dim = keys.shape
        self.prompt_len = n_tokens
        n_slots = self.n_sink + self.n_local
        self.gpu_keys = keys.new_zeros(n_kv_heads, n_slots, head_dim)
        self.gpu_values = values.new_zeros(n_kv_heads, n_slots, head_dim)
        self.gpu_positions = torch.full((n_slots,), -1, dtype=torch.long, device=device)
        n_sinks_placed = min(self.n_sink, n_tokens)  # a prompt shorter than the sinks has no window yet
        placed = torch.cat([torch.arange(n_sinks_placed, device=device),
                            torch.arange(max(n_sinks_placed, n_tokens - self.n_local), n_tokens, device=device)])
        slots = self._ring_slot(placed)
        self.gpu_keys[:, slots], self.gpu_values[:, slots] = keys[:, placed], values[:, placed]
        self.gpu_positions[slots] = placed

        # Every token in host memory: those in the window join the middle as they leave it.
        # Buffers of the host pool, kept across sequences: a position is read only once written (the prompt's by the
        # copies below, later ones by the host step).
        capacity = storage_capacity(self.seq, n_tokens + 1, 0)
        take = self.seq.prompt_copies.take
        self.store_keys = take((n_kv_heads, capacity, head_dim), keys.dtype, device)
        self.store_values = take((n_kv_heads, capacity, head_dim), values.dtype, device)
        middle_end = max(self.n_sink, n_tokens - self.n_local)
        centred_on = keys[:, self.n_sink : middle_end] if middle_end > self.n_sink else keys
        self.mean_key = centred_on.float().mean(dim=1)  # [Hkv, D], on the device
        # Copied with the store rather than read back at once: reading it here would stall the launches of the
        # next layers' prefill on every layer.
        self.mean_key_host = take(tuple(self.mean_key.shape), torch.float32, device)
        self.seq.prompt_copies.copy(self.mean_key_host, self.mean_key)
        self.store_norms = take((n_kv_heads, capacity), torch.float32, device)
        norms = (keys.float() - self.mean_key[:, None]).norm(dim=-1)
        for head in range(n_kv_heads):  # one copy per KV head: each head's rows are contiguous in the store
            for destination, source in ((self.store_keys[head, :n_tokens], keys[head]),
                                        (self.store_values[head, :n_tokens], values[head]),
                                        (self.store_norms[head, :n_tokens], norms[head])):
                self.seq.prompt_copies.copy(destination, source)

        # A layer's own copy (counted in its device bytes), copied on the device from the sequence's draw.
        self.projections = self.seq.state(MagicPIGSequence).projections(device, head_dim, cfg.K, cfg.L,
                                                                         cfg.seed).clone()
        self.tables = self._hash_prompt(keys)
        self.tail_codes = torch.zeros(n_kv_heads, capacity - n_tokens, cfg.L, dtype=torch.int32)

        f32, i32 = torch.float32, torch.int32
        n_heads, n_tables = self.model.n_heads, cfg.L
        # A traced sequence of fixed trace width gets its trace from the host step with the output, so that a
        # captured step's trace is that of each replay.
        width = self.seq.fixed_trace_width
        trace = {"attended": ((n_heads, width), torch.bool), "log_weights": ((n_heads, width), f32)} if width else {}
        self.exchange = HostExchange(
            to_host={"query": ((n_heads, head_dim), f32), "key": ((n_kv_heads, head_dim), f32),
                     "value": ((n_kv_heads, head_dim), f32), "query_codes": ((n_heads, n_tables), i32),
                     "key_codes": ((n_kv_heads, n_tables), i32), "position": ((1,), torch.int64)},
            to_device={"out": ((n_heads, head_dim), f32), "lse": ((n_heads,), f32), **trace},
            device=device, host_functions=self.seq.host_functions,
        )
        self.scaling = 1.0
        self.native = self._make_native_step(keys.dtype)
        self.offloaded = True

    def _hash_prompt(self, keys: torch.Tensor) -> HashTables | None:
        """The hash tables of the prompt's middle (after the sinks), their host arrays' fills queued. On CUDA the
        codes, the sort and the fills run on the sequence's hashing stream after the model's stream has produced the
        keys and their mean, beside the next layers' prefill; the fills follow the sort on the copy stream, so the
        first decode step's ``prompt_copies.join()`` waits for both."""
        middle = keys[:, self.n_sink :]
        if not middle.shape[1]:
            return None
        side = self.seq.state(MagicPIGSequence).hashing_stream(keys.device) if keys.is_cuda else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(keys.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            codes = torch.cat([
                simhash_codes(middle[:, begin : begin + HASH_BLOCK_TOKENS].float() - self.mean_key[:, None],
                              self.projections, self.cfg.K)
                for begin in range(0, middle.shape[1], HASH_BLOCK_TOKENS)
            ], dim=1)
            fills: list[tuple[torch.Tensor, torch.Tensor]] = []
            tables = HashTables(codes, self.n_sink, self.cfg.K, self.seq.prompt_copies, fills)
            for destination, source in fills:  # queued while the hashing stream is current: they follow the sort
                self.seq.prompt_copies.copy(destination, source)
        if side is not None:
            # The model's stream may reuse the prompt's memory only once the hashing stream is past its reads.
            for tensor in (keys, self.mean_key, self.projections):
                tensor.record_stream(side)
        return tables

    def _make_native_step(self, store_dtype: torch.dtype):
        """The layer's C++ host step (``_magicpig_host.HostStep``), pointed at the tables, the mean key and the
        exchange's host buffers, which live as long as the layer (the store is pointed at by ``_point_at_store``).
        Its threads: torch's CPU threads, which the torch step this replaced ran on."""
        cfg, model = self.cfg, self.model
        if store_dtype not in _STORE_DTYPES or self.store_values.dtype != store_dtype:
            raise ValueError(f"magicpig: no host step for keys of {store_dtype} and values of "
                             f"{self.store_values.dtype}")
        native = _magicpig_host.HostStep(
            layer=self.layer_idx, n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, head_dim=model.head_dim,
            K=cfg.K, L=cfg.L, n_sink=self.n_sink, n_local=self.n_local, cap=self.cap, capped=cfg.capped,
            seed=cfg.seed, prompt_len=self.prompt_len, store_dtype=_STORE_DTYPES[store_dtype],
            threads=torch.get_num_threads(),
        )
        if self.tables is not None:
            native.set_tables(self.tables.offsets.data_ptr(), self.tables.positions.data_ptr(),
                              self.tables.positions.shape[-1])
        native.set_mean_key(self.mean_key_host.data_ptr())
        inputs, outputs = self.exchange.host_in, self.exchange.host_out
        traced = "attended" in outputs
        native.set_exchange(
            query=inputs["query"].data_ptr(), key=inputs["key"].data_ptr(), value=inputs["value"].data_ptr(),
            query_codes=inputs["query_codes"].data_ptr(), key_codes=inputs["key_codes"].data_ptr(),
            position=inputs["position"].data_ptr(), out=outputs["out"].data_ptr(), lse=outputs["lse"].data_ptr(),
            attended=outputs["attended"].data_ptr() if traced else 0,
            log_weights=outputs["log_weights"].data_ptr() if traced else 0,
            trace_width=outputs["attended"].shape[1] if traced else 0,
        )
        self._point_at_store(native)
        return native

    def _point_at_store(self, native) -> None:
        native.set_store(self.store_keys.data_ptr(), self.store_values.data_ptr(), self.store_norms.data_ptr(),
                         self.tail_codes.data_ptr(), self.store_keys.shape[1])

    def _grow_store(self, needed: int) -> None:
        """Room for ``needed`` tokens, between steps (the C++ step writes into the store but never resizes it)."""
        capacity = self.store_keys.shape[1]
        if needed <= capacity:
            return
        grown = max(needed, 2 * capacity)
        if torch.cuda.is_available() and self.store_keys.is_pinned():
            torch.cuda.synchronize()  # the prompt's copies into the store are done before it is read here
        self.store_keys = grown_along(self.store_keys, grown, 1)
        self.store_values = grown_along(self.store_values, grown, 1)
        self.store_norms = grown_along(self.store_norms, grown, 1)
        self.tail_codes = grown_along(self.tail_codes, grown - self.prompt_len, 1)
        self._point_at_store(self.native)

    # --- decode ----------------------------------------------------------------------------------------------------
    #
    # The device writes the new token into the ring, hashes the query and the key, sends them to the host
    # (``HostExchange``) and attends the sinks and window; the host's part is one C++ call
    # (``exchange.run_native``): called at once eagerly, a hand-off of the graph when the step is captured. What
    # it needs from Python (room in the store) is made before the step or between replays (``between_steps``),
    # and what it counted and timed is folded into the sequence after it (``_after_native_step``).

    def decode(self, query, key, value, scaling):
        if query.shape[0] != 1:
            raise ValueError("sparse KV methods run with batch size 1")
        self.seq.prompt_copies.join()  # the host step reads what the prompt's copies wrote
        position = self.decode_position(key.device)
        slot = self._ring_slot(position)
        self.gpu_keys.index_copy_(1, slot, key[0])
        self.gpu_values.index_copy_(1, slot, value[0])
        self.gpu_positions.index_copy_(0, slot, position)
        q = query[0, :, 0].float()
        new_key, new_value = key[0, :, 0].float(), value[0, :, 0].float()
        with self.seq.timer.phase("hash"):
            query_codes = simhash_codes(q, self.projections, self.cfg.K)
            key_codes = simhash_codes(new_key - self.mean_key, self.projections, self.cfg.K)
        self._prepare_native_step(scaling)
        self.exchange.send(query=q, key=new_key, value=new_value, query_codes=query_codes, key_codes=key_codes,
                           position=position)
        gpu_out, gpu_lse = self._window_attention(q, scaling)
        # The host's part (magicpig_host.cpp): store the token, count the collisions, sample, attend to the sample
        # (and a fixed-width trace), timed as the phases ``select`` and ``cpu_attention``.
        self.exchange.run_native(*self.native.step_entry())
        self._after_native_step()  # nothing ran yet while capturing: between_steps folds a replay's
        host = self.exchange.receive()
        lse = torch.logaddexp(gpu_lse, host["lse"])
        out = torch.exp(gpu_lse - lse)[:, None] * gpu_out + torch.exp(host["lse"] - lse)[:, None] * host["out"]
        if self.seq.trace_selection:
            if "attended" in host:  # written by the host step (a fixed width), else made here
                self.last_attended, self.last_log_weights = host["attended"], host["log_weights"]
            else:
                self.last_attended, self.last_log_weights = self._traced(self.trace_width())
        return out.view(1, 1, *q.shape).to(query.dtype)

    def between_steps(self) -> None:
        """After a replayed step (and before a capture): raise what the C++ step failed with, fold what it counted
        and timed, and make room in the store for the next step."""
        if self.offloaded:
            self._after_native_step()
            self._prepare_native_step(self.scaling)

    def _prepare_native_step(self, scaling: float) -> None:
        """Room in the store for the step of position ``seq_len`` (the one about to run, or the next replay's) and
        the model's scaling, which the C++ step reads."""
        self._grow_store(self.seq_len + 1)
        if scaling != self.scaling:
            self.scaling = scaling
            self.native.set_scaling(scaling)

    def _after_native_step(self) -> None:
        """Raise the error a C++ step kept (every later one did nothing), then fold what the steps since the last
        call counted and timed into the sequence's counters and timer, under the names the results use."""
        error = self.native.error()
        if error:
            raise RuntimeError(f"MagicPIG's host step failed: {error}")
        records = self.native.take_records()
        for mean in records["attended"]:
            self.seq.counters.record_attention(mean)
        for name, seconds in records["phases"].items():
            self.seq.timer.add_host_phase(name, seconds)
        self.seq.timer.add_spans("host_step", records["host_step"])

    def _window_attention(self, q: torch.Tensor, scaling: float):
        """Exact attention over the device's sinks and window: float32 ``(out [Hq, D], lse [Hq])``."""
        n_kv_heads, n_slots, head_dim = self.gpu_keys.shape
        scores = torch.einsum("hgd,hsd->hgs", q.view(n_kv_heads, self.group, head_dim), self.gpu_keys.float())
        scores = (scores * scaling).masked_fill(self.gpu_positions[None, None, :] < 0, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[..., None])
        out = torch.einsum("hgs,hsd->hgd", probs, self.gpu_values.float())
        return out.reshape(-1, head_dim), lse.reshape(-1)

    def last_sample(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The last step's middle sample on the host: ``(positions [Hq, M], valid [Hq, M], log_weights [Hq, M])``,
        each head's positions in increasing order, then unused entries (``valid`` false)."""
        positions, valid, log_weights = self.native.last_sample()
        return torch.from_numpy(positions), torch.from_numpy(valid), torch.from_numpy(log_weights)

    def _traced(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The trace (``[Hq, width]``) from the device's ring and the host's last sample, for a sequence that fixes
        no trace width (so not in the host step's output)."""
        device = self.gpu_positions.device
        attended = torch.zeros(self.model.n_heads, width, dtype=torch.bool)
        log_weights = torch.zeros(self.model.n_heads, width)
        on_device = self.gpu_positions.cpu()
        attended[:, on_device[on_device >= 0]] = True
        positions, valid, weights = self.last_sample()
        heads = torch.arange(self.model.n_heads)[:, None].expand_as(positions)
        attended[heads[valid], positions[valid]] = True
        log_weights[heads[valid], positions[valid]] = weights[valid]
        return attended.to(device), log_weights.to(device)

    def gpu_kv_bytes(self) -> int:
        if not self.offloaded or self.gpu_keys.device.type != "cuda":
            return super().gpu_kv_bytes()
        return self.gpu_keys.nbytes + self.gpu_values.nbytes + self.projections.nbytes

    def cpu_kv_bytes(self) -> int:
        if not self.offloaded:
            return 0
        tables = self.tables.nbytes() if self.tables is not None else 0
        return (self.store_keys.nbytes + self.store_values.nbytes + self.store_norms.nbytes + self.tail_codes.nbytes
                + tables)


@METHODS.register("magicpig")
class MagicPIG(Method):
    display_name = "MagicPIG"
    display_order = 80
    paper_names = ("MPG",)
    config_class = MagicPIGConfig
    traces_in_graph = True
    speed_goals = (
        SpeedGoal(131072, "tpot", 5.2, "5.2x its full cache at 128k (ParisKV's head-to-head), its host part on "
                                        "AVX-512"),
        SpeedGoal(32768, "tpot", 5.0, "its host part on AVX-512 beside the GPU's sink and window attention"),
        *prompt_offload_goals("the prompt's KV copied to the host beside the next layers' prefill"),
    )
    # At the shared tests' budget of 64: 4 sinks, a window of 16 and up to 44 sampled tokens.
    test_settings = {"n_local_tokens": 16}

    def check(self) -> None:
        super().check()
        c = self.config
        if not 1 <= c.K <= MAX_HASH_BITS:
            raise ConfigError(f"magicpig: K={c.K} bits per table must lie in [1, {MAX_HASH_BITS}]")
        if c.L < MIN_COLLISIONS:
            raise ConfigError(f"magicpig: L={c.L} tables cannot give the {MIN_COLLISIONS} collisions that sample a key")
        if c.n_sink_tokens < 0 or c.n_local_tokens < 1:
            raise ConfigError(f"magicpig: n_sink_tokens={c.n_sink_tokens} must be >= 0 and n_local_tokens="
                              f"{c.n_local_tokens} >= 1 (the window holds the new token)")

    def forced_positions(self, n_tokens):
        c = self.config
        sinks = list(range(min(c.n_sink_tokens, n_tokens)))
        return sinks + list(range(max(len(sinks), n_tokens - c.n_local_tokens), n_tokens))

    def make_sparse_layer(self, layer_idx, seq):
        return MagicPIGKV(layer_idx, self.model, seq, self.config)
