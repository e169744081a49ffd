"""Per-layer KV storage: the objects a method builds for every layer, and the state a sequence's layers share.

``LayerKV`` is what a method implements: it stores one layer's keys and values and computes that layer's
attention, seeing the prompt's queries, keys and values at prefill (post-RoPE, GQA not expanded) and at each
decode step the new query, key and value. ``DenseKV`` is the full cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .attention import dense_attention, dense_attention_and_lse
from .cuda_driver import HostFunctions
from .host_memory import PromptCopies
from .rope import Rotary
from .timing import DecodeCounters, PhaseTimer


@dataclass(frozen=True)
class ModelInfo:
    """The attention geometry a method needs, read from the model's config."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    # The model's RoPE, for methods that need the keys before it (None: not known, as for a bare geometry).
    rotary: Rotary | None = None
    # The positions the model's config declares (max_position_embeddings; None: the config names none).
    max_positions: int | None = None

    @classmethod
    def from_config(cls, config: Any, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        n_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        return cls(
            n_layers=config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            device=torch.device(device),
            dtype=dtype,
            rotary=Rotary.from_config(config),
            max_positions=getattr(config, "max_position_embeddings", None),
        )

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads


State = TypeVar("State")


@dataclass
class SequenceContext:
    """Per-sequence state shared by the layers of one cache (no globals): timers, counters, phase flags."""

    timer: PhaseTimer = field(default_factory=PhaseTimer)
    counters: DecodeCounters = field(default_factory=DecodeCounters)
    # With measure_selection (core.selection_quality.SelectionMeter): measures every decode step of the sparsified
    # layers against their exact attention; None (the default) costs one attribute read per attention call.
    selection_meter: Any = None
    more_prefill_chunks: bool = False  # set by the generation loop for every prefill chunk but the last
    trace_selection: bool = False  # layers record the token positions they attend to (tests, analysis)
    # With trace_selection, set by the generation loop to the announced length: the columns of every decode step's
    # ``last_attended`` (``LayerKV.trace_width``), one shape for the whole sequence, so that a traced step can be
    # captured in a CUDA graph. None: each step's trace has as many columns as tokens seen.
    trace_width: int | None = None
    # Set by the generation loop: the device tensor [S] of the current forward's positions (a CUDA-graphed step
    # reads it on every replay, so layers that support graphs take positions from it, never from Python ints),
    # and the most tokens the sequence will reach (prompt + suffix + new tokens), for static buffers.
    position: torch.Tensor | None = None
    max_total_tokens: int | None = None
    # Host work a layer hands off from the stream (cuda_driver.HostFunctions): the sequence's channel (its worker
    # starts at the first captured hand-off), with the entries kept alive as long as the graphs that replay them.
    host_functions: HostFunctions = field(default_factory=HostFunctions)
    # The prompt's copies to host memory and the host buffers the sequence holds (core.host_memory): buffers come
    # from the pool of the method (or of the harness, shared across methods) and go back to it at ``close``.
    prompt_copies: PromptCopies = field(default_factory=PromptCopies)
    _states: dict[type, Any] = field(default_factory=dict, repr=False)

    @property
    def fixed_trace_width(self) -> int:
        """The trace width of a traced sequence that fixes one, else 0: what a layer sizes a trace buffer of its
        host step by, made before the first decode step."""
        return (self.trace_width or 0) if self.trace_selection else 0

    def state(self, kind: type[State]) -> State:
        """The sequence's one instance of ``kind`` (made on first use as ``kind()``): what the layers of a method
        share within a sequence (an index one layer builds and the next reads, a worker thread), typed, and gone
        with the sequence. An instance with a ``close()`` method is closed by ``close``."""
        found = self._states.get(kind)
        if found is None:
            found = self._states[kind] = kind()
        return found

    def close(self) -> None:
        """The sequence has ended: close the states that hold workers or other resources, and stop and join the
        host channel's worker."""
        for found in self._states.values():
            close = getattr(found, "close", None)
            if close is not None:
                close()
        self.host_functions.close()
        self.prompt_copies.close()  # last: a state's worker may still read the buffers until it is closed


def storage_capacity(seq: SequenceContext, needed: int, current: int) -> int:
    """Tokens a growing KV buffer should hold for ``needed`` tokens: the sequence's announced length when it covers
    them (sized once: doubling alone would, at 128k, double the whole cache at the first decode token), else the
    larger of ``needed`` and twice ``current`` (at least 256)."""
    announced = seq.max_total_tokens or 0
    return announced if announced >= needed else max(needed, 2 * current, 256)


class LayerKV(ABC):
    """One layer's KV storage and attention. ``seq_len`` is the logical number of tokens seen."""

    def __init__(self, layer_idx: int, model: ModelInfo, seq: SequenceContext):
        self.layer_idx = layer_idx
        self.model = model
        self.seq = seq
        self.seq_len = 0
        # With seq.trace_selection: bool [Hq, trace_width()] of the positions each query head attended at the last
        # decode step (False past the tokens seen).
        self.last_attended: torch.Tensor | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        """Store the new tokens and attend; ``query [B, Hq, S, D]`` -> ``[B, S, Hq, D]``."""
        is_prefill = query.shape[-2] > 1 or self.seq_len == 0
        if is_prefill:
            out = self.prefill(query, key, value, attention_mask, scaling)
        else:
            out = self.decode(query, key, value, scaling)
        self.seq_len += key.shape[-2]
        return out

    def decode_position(self, device: torch.device) -> torch.Tensor:
        """The one-element device tensor of the decode step's position: ``SequenceContext.position``, which a
        captured step reads on every replay, or, called outside the generation loop (nothing captured), the host's
        ``seq_len``."""
        if self.seq.position is None:
            return torch.full((1,), self.seq_len, dtype=torch.long, device=device)
        return self.seq.position[:1]

    def trace_width(self) -> int:
        """Columns of a decode step's ``last_attended``, called during the step (before ``seq_len`` counts the new
        token): ``seq.trace_width`` when the sequence fixes one, else the tokens seen with the new one. A method
        whose layers build their trace at this width in a way a CUDA graph repeats declares
        ``Method.traces_in_graph``."""
        n_tokens = self.seq_len + 1
        fixed = self.seq.trace_width
        return fixed if fixed is not None and fixed >= n_tokens else n_tokens

    @abstractmethod
    def prefill(self, query, key, value, attention_mask, scaling) -> torch.Tensor:
        """A prompt chunk; ``self.seq.more_prefill_chunks`` says whether more follow."""

    @abstractmethod
    def decode(self, query, key, value, scaling) -> torch.Tensor:
        """One new token (``S = 1``)."""

    @classmethod
    def decode_rows(cls, layers: tuple[LayerKV, ...], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scaling: float) -> torch.Tensor | None:
        """One decode step of a batch's rows in one go (``core.batch``): ``layers[b]`` is row ``b``'s layer (all of
        this class, every one past its prompt), ``query [B, Hq, 1, D]``, ``key``/``value [B, Hkv, 1, D]``; returns
        ``[B, 1, Hq, D]``, each row what its own ``decode`` returns, or None to have the rows decode one by one (the
        default; a method may also decline one step, e.g. when its rows' layouts differ). The caller counts the new
        token in every row's ``seq_len``. A method whose step is a few kernels overrides it to launch each kernel
        once for all rows (``kernels.row_table``), where row by row a batch costs B launches of each."""
        return None

    @property
    def graph_ready(self) -> bool:
        """Whether the next decode step may be captured in a CUDA graph (for methods that ``captures_decode_step``):
        a layer whose decode still takes a host-side branch that a replay would not repeat (IceCache before its
        prompt is offloaded) says no, and the step runs eagerly."""
        return True

    @property
    def wants_previous_layer_input(self) -> bool:
        """Whether the generation loop should hand this layer the previous decoder layer's input at every forward
        (``core.layer_inputs``): a layer that starts its own step's work one layer early says yes."""
        return False

    def previous_layer_input(self, hidden: torch.Tensor, project_query) -> None:  # noqa: B027  optional hook
        """The previous decoder layer's input ``hidden [B, S, hidden]``, before that layer runs, and
        ``project_query(hidden) -> [B, Hq, S, D]``: this layer's own post-RoPE query projection at the forward's
        positions. Called only where ``wants_previous_layer_input``."""

    def between_steps(self) -> None:  # noqa: B027  an optional hook: most layers need no upkeep
        """Host-side upkeep the generation loop runs after every replayed decode step, outside the graph (where
        CUDA may be called: allocating pinned memory, say)."""

    def gpu_kv_bytes(self) -> int:
        return 0

    def cpu_kv_bytes(self) -> int:
        return 0

    def offloaded_kv_bytes(self) -> int:
        """Bytes of the keys and values this layer keeps off the GPU, counted at the model's dtype: what
        ``cpu_kv_bytes`` (all the host memory the layer holds for them) is measured against."""
        return 0


class DenseKV(LayerKV):
    """The full cache: every token kept on the model's device, dense attention. Storage follows
    ``storage_capacity``: the announced length, else doubling."""

    #: Keep the prompt chunk's row log-sum-exps where the attention kernel gives them (``prefill_lse``): a layer
    #: whose prompt statistic needs them (H2O's accumulated attention) says yes.
    keeps_prefill_lse = False

    def __init__(self, layer_idx: int, model: ModelInfo, seq: SequenceContext):
        super().__init__(layer_idx, model, seq)
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self.length = 0  # physical tokens stored
        self.prefill_lse: torch.Tensor | None = None  # [B, Hq, S] of the last prompt chunk, when kept and given

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        batch, n_kv_heads, n_new, head_dim = key.shape
        needed = self.length + n_new
        if self._keys is None or needed > self._keys.shape[2]:
            capacity = storage_capacity(self.seq, needed, self._keys.shape[2] if self._keys is not None else 0)
            grown_k = key.new_empty(batch, n_kv_heads, capacity, head_dim)
            grown_v = value.new_empty(batch, n_kv_heads, capacity, head_dim)
            if self._keys is not None:
                grown_k[:, :, : self.length] = self._keys[:, :, : self.length]
                grown_v[:, :, : self.length] = self._values[:, :, : self.length]
            self._keys, self._values = grown_k, grown_v
        self._keys[:, :, self.length : needed] = key
        self._values[:, :, self.length : needed] = value
        self.length = needed

    @property
    def keys(self) -> torch.Tensor:
        return self._keys[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self._values[:, :, : self.length]

    def prefill(self, query, key, value, attention_mask, scaling):
        self.append(key, value)
        if self.keeps_prefill_lse and attention_mask is None:
            out, self.prefill_lse = dense_attention_and_lse(query, self.keys, self.values, scaling)
            return out
        return dense_attention(query, self.keys, self.values, scaling, attention_mask)

    def decode(self, query, key, value, scaling):
        self.append(key, value)
        if self.seq.trace_selection:
            self.last_attended = attended_prefix(query.shape[1], self.length - 1, self.trace_width(), query.device)
        return dense_attention(query, self.keys, self.values, scaling)

    def gpu_kv_bytes(self) -> int:
        if self._keys is None or self._keys.device.type != "cuda":
            return 0
        return 2 * self._keys[:, :, : self.length].numel() * self._keys.element_size()


def attended_from_positions(positions: torch.Tensor, valid: torch.Tensor, width: int, group: int) -> torch.Tensor:
    """A trace from a selection: bool ``[H * group, width]``, True at ``positions[h, ...]`` where ``valid`` (same
    shape, ``[H, ...]``) for each of the ``group`` query heads that read KV head ``h``. Static shapes: invalid
    entries go to a spare column that is cut off, so this runs on the device inside a captured step."""
    attended = torch.zeros(positions.shape[0], width + 1, dtype=torch.bool, device=positions.device)
    attended.scatter_(1, torch.where(valid, positions, width).flatten(1), True)
    attended = attended[:, :width]
    return attended.repeat_interleave(group, dim=0) if group > 1 else attended


def attended_prefix(n_heads: int, last: int | torch.Tensor, width: int, device: torch.device) -> torch.Tensor:
    """The trace of a step that attends every token: bool ``[n_heads, width]``, True at positions ``0 .. last``
    (an int, or a one-element device tensor that a captured step reads)."""
    return (torch.arange(width, device=device) <= last).expand(n_heads, width)
