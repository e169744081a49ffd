"""The method contract: what a KV-selection method sees and owns, per layer.

A method is a small dataclass of settings (``MethodConfig`` subclass) plus a ``Method`` subclass registered in
``METHODS``. For every layer the method builds a ``LayerKV``: the object that stores that layer's keys and values
and computes its attention. It sees, per layer, the prompt's queries, keys and values at prefill (post-RoPE, GQA
not expanded) and at each decode step the new query, key and value. Layers ``0 .. n_dense_layers-1`` always keep
the full cache (``DenseKV``).

``budget`` has one meaning for every method: the number of KV token slots each query head may attend to at a
decode step in a sparsified layer, sink, selected and recent tokens included.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from icecache.errors import ConfigError, dataclass_from_dict
from icecache.registry import Registry

from .host_memory import HostPool
from .layer import DenseKV, LayerKV, ModelInfo, SequenceContext, storage_capacity
from .static_kv import StaticDenseKV

__all__ = ["METHODS", "SPEED_MEASURES", "DenseKV", "LayerKV", "Method", "MethodConfig", "ModelInfo", "SequenceContext",
           "SpeedGoal", "StaticDenseKV", "build_method", "in_run_identity_unless_default", "method_class",
           "method_settings", "not_in_run_identity", "prompt_offload_goals", "run_identity", "storage_capacity"]


def not_in_run_identity(default: Any) -> Any:
    """A config field that cannot change a run's numbers (how host threads wait, say), declared so: it is left out
    of the run's identity, which names the run's directory, so that adding such a setting, or changing it, leaves
    finished and half-finished runs where they are found."""
    return dataclasses.field(default=default, metadata={"run_identity": False})


def in_run_identity_unless_default(default: Any) -> Any:
    """A config field added after runs were made, whose default does what those runs did (the option did not exist,
    so they ran its default): left out of the run's identity while at its default, so that those runs keep their
    directories and are not run again; any other value names runs of its own."""
    return dataclasses.field(default=default, metadata={"run_identity": "unless_default"})


def run_identity(config_class: type, settings: dict[str, Any]) -> dict[str, Any]:
    """The method settings that name a run: its config class's fields, less those declared outside the identity and
    those added later that are at their default."""
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    identity = {}
    for key, value in settings.items():
        declared = fields.get(key)
        if declared is None:
            continue
        rule = declared.metadata.get("run_identity", True)
        if rule is False or (rule == "unless_default" and value == declared.default):
            continue
        identity[key] = value
    return identity


BUDGET_TYPE_MESSAGE = "budget={value!r} must be a whole number of tokens (or null for budget-free methods)"


@dataclass
class MethodConfig:
    """Settings shared by every method; each method extends this with its own knobs."""

    name: str = "full"
    budget: int | None = None
    n_dense_layers: int = 2
    # On CUDA, replay the decode step from a CUDA graph (methods that ``supports_cuda_graph``); false decodes eagerly.
    # No effect on CPU.
    cuda_graph: bool = True

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "MethodConfig":
        return dataclass_from_dict(cls, values, "method", messages={"budget": BUDGET_TYPE_MESSAGE})

    # The budget's rules, for a method that uses one (``Method.uses_budget``): ``check_budget`` holds the budget to
    # what the settings alone decide (the runner calls it before any model is read), ``check_min_budget`` to the
    # least the method's fixed parts need (``build_method`` calls it once the method's own checks have passed).

    def budget_page_size(self) -> int | None:
        """The page the budget must be a whole number of (a paged method's ``page_size``); None: any token count."""
        return None

    def min_budget(self) -> int:
        """The smallest budget these settings accept (their fixed parts and one more token or page)."""
        return 1

    def min_budget_reason(self) -> str:
        """What the smallest budget is made of, in the method's own settings (ends the message of a budget below
        it)."""
        return "the least its fixed parts need"

    def check_budget(self) -> None:
        """``ConfigError`` unless the budget is a positive whole number of the method's pages."""
        budget = self.budget
        if budget is None:
            raise ConfigError(f"method {self.name!r} needs a budget: add budget=<tokens>")
        if budget <= 0:
            raise ConfigError(f"budget={budget}: method {self.name!r} needs a positive number of tokens (KV slots per "
                              f"query head), e.g. budget=256")
        page = self.budget_page_size()
        if isinstance(page, int) and page > 0 and budget % page:
            lower, upper = budget // page * page, (budget // page + 1) * page
            raise ConfigError(
                f"budget {budget} is not a multiple of {self.name}'s page size {page}: the method attends whole pages "
                f"({lower} tokens at this budget); use budget={upper}" + (f" or {lower}" if lower else "")
            )

    def check_min_budget(self, least: int | None = None) -> None:
        """``ConfigError`` if the budget is below ``least`` (by default ``min_budget``)."""
        least = self.min_budget() if least is None else least
        if self.budget < least:
            raise ConfigError(f"{self.name}: budget={self.budget} is below {least} = {self.min_budget_reason()}: "
                              f"raise the budget")


#: What a ``SpeedGoal`` measures: the key it reads (a latency file's summary row's, TTFT and TT2T from its last round,
#: or a throughput file's), the reference method of the same file it is divided by, and whether lower is better (a
#: goal is then an upper bound).
SPEED_MEASURES: dict[str, tuple[str, str, bool]] = {
    "tpot": ("tpot_s_median", "full_static", True),
    "ttft": ("ttft_s", "full", True),
    "tt2t": ("tt2t_s", "full_static", True),
    "throughput": ("best_tokens_per_s", "full_static", False),
}


@dataclass(frozen=True)
class SpeedGoal:
    """A speed the method's design reaches, checked against the benchmark files (BENCHMARKS.md, "Speed goals"): at
    ``context`` tokens (Llama-3.1-8B, budget 256), the ``measure`` over its reference's in the same file is at most
    ``bound`` (``tpot``: TPOT over ``full_static``'s; ``ttft``: TTFT over ``full``'s; ``tt2t``: time to the second
    token over ``full_static``'s) or at least ``bound`` (``throughput``: the best decode tokens per second over any
    batch size, over ``full_static``'s best), for the method with ``settings`` (a variant's, as the latency
    benchmark names it: ``lookahead=true``) or its defaults. ``source`` says where the number comes from."""

    context: int
    measure: str
    bound: float
    source: str
    settings: str = ""

    def __post_init__(self) -> None:
        if self.measure not in SPEED_MEASURES:
            raise ValueError(f"SpeedGoal.measure={self.measure!r} must be one of {sorted(SPEED_MEASURES)}")

    @property
    def lower_is_better(self) -> bool:
        return SPEED_MEASURES[self.measure][2]

    def met_by(self, value: float) -> bool:
        return value <= self.bound if self.lower_is_better else value >= self.bound


def prompt_offload_goals(source: str) -> tuple[SpeedGoal, ...]:
    """The first token of a method that offloads its prompt at most 1.2x the full cache's, at 32k and 128k: the
    offload runs beside the prefill, not after it."""
    return tuple(SpeedGoal(context, "ttft", 1.2, source) for context in (32768, 131072))


class Method(ABC):
    """A KV-selection method: its config and a factory of per-layer ``LayerKV`` objects.

    ``supports_cuda_graph`` says that the method's decode step makes no host decision a replay would skip: its
    layers take positions from ``SequenceContext.position`` (a device tensor), size their buffers before the first
    step, do selection on the device and enqueue any host work as host functions. A method that sets it false says
    why in its docstring."""

    config_class: ClassVar[type[MethodConfig]] = MethodConfig
    uses_budget: ClassVar[bool] = True
    supports_cuda_graph: ClassVar[bool] = True
    #: Whether its layers build ``last_attended`` in a way a CUDA graph repeats at every replay: device operations
    #: of fixed shape at ``LayerKV.trace_width`` columns, or host state written by the step's own host function
    #: into a fixed buffer that the step copies to the device. Then a traced or measured decode step is captured
    #: too; else such steps run eagerly.
    traces_in_graph: ClassVar[bool] = False
    #: The name tables and figures print (the paper's); None: the registry name.
    display_name: ClassVar[str | None] = None
    #: Where tables and figures list the method, lowest first: the paper's order (the full cache, the oracle, the
    #: evicting methods, the selecting ones, IceCache last). A method's variants follow it.
    display_order: ClassVar[int] = 1000
    #: Other spellings of the method in the paper's tables and figures (matched case-insensitively, without spaces),
    #: besides its registry name and ``display_name``.
    paper_names: ClassVar[tuple[str, ...]] = ()
    #: Settings for the shared invariant tests on tiny models at a 64-token budget (pages of 8 tokens, say, so that
    #: the budget holds several); the method's defaults otherwise.
    test_settings: ClassVar[dict[str, Any]] = {}
    #: Opt-in variants of the method: variant name -> the settings that make it. The invariant tests run each (over
    #: ``test_settings``), and a run with a variant's settings is labelled ``<name>+<variant>`` (``method_label``).
    variants: ClassVar[dict[str, dict[str, Any]]] = {}

    #: Whether sequences may decode together under this method (``core.batch``: one forward for the batch, each
    #: row attending with its own layers). A method that cannot says why in its docstring and ``batch_refusal``.
    batches_decode: ClassVar[bool] = True
    batch_refusal: ClassVar[str] = ""
    #: The speeds its design reaches (``SpeedGoal``), which BENCHMARKS.md checks against the newest latency and
    #: throughput files.
    speed_goals: ClassVar[tuple[SpeedGoal, ...]] = ()

    def check_batch_size(self, batch_size: int) -> None:
        """``ConfigError`` unless ``batch_size`` sequences may decode together under this method."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r} must be a whole number of sequences, at least 1")
        if batch_size > 1 and not self.batches_decode:
            raise ConfigError(f"{self.config.name} decodes one sequence at a time ({self.batch_refusal}): "
                              f"use batch_size=1")

    @property
    def captures_decode_step(self) -> bool:
        """Whether the generation loop captures this run's decode steps in a CUDA graph (on CUDA, when the method
        supports it and ``cuda_graph`` is on)."""
        return self.supports_cuda_graph and self.config.cuda_graph and self.model.device.type == "cuda"

    def __init__(self, config: MethodConfig, model: ModelInfo):
        self.config = config
        self.model = model
        # Host buffers this method's sequences reuse, one after the other (core.host_memory); a harness that runs
        # several methods may give their caches one shared pool instead.
        self.host_pool = HostPool()

    def check(self) -> None:
        """Raise ``ConfigError`` if the settings cannot work for this model (called before any weights load)."""
        if self.uses_budget:
            self.config.check_budget()
        if not 0 <= self.config.n_dense_layers <= self.model.n_layers:
            raise ConfigError(
                f"n_dense_layers={self.config.n_dense_layers} must lie in [0, {self.model.n_layers}] for this model"
            )

    def min_budget(self) -> int:
        """The smallest budget these settings accept: the config's (``MethodConfig.min_budget``); ``build_method``
        refuses anything below it, after ``check``."""
        return self.config.min_budget()

    def forced_positions(self, n_tokens: int) -> list[int]:
        """The positions a decode step with ``n_tokens`` tokens (the new one included) attends whatever it selects:
        the paper's sinks and recent window. The invariant tests hold every step of every method to it."""
        return []

    def make_layer(self, layer_idx: int, seq: SequenceContext) -> LayerKV:
        if layer_idx < self.config.n_dense_layers:
            return self.make_dense_layer(layer_idx, seq)
        return self.make_sparse_layer(layer_idx, seq)

    def make_dense_layer(self, layer_idx: int, seq: SequenceContext) -> LayerKV:
        """The full cache of a dense layer: in static buffers a graph can capture when the step is captured (the
        same kernel then serves eager steps too, so graphed and eager steps compute the same thing), else the plain
        ``DenseKV``."""
        if self.captures_decode_step:
            return StaticDenseKV(layer_idx, self.model, seq, page_size=16)
        return DenseKV(layer_idx, self.model, seq)

    @abstractmethod
    def make_sparse_layer(self, layer_idx: int, seq: SequenceContext) -> LayerKV:
        """The method's own layer, for layers at or above ``n_dense_layers``."""


METHODS: Registry[type[Method]] = Registry("method")


def method_class(name: str | None) -> type[Method]:
    """The registered class of a method name. The method modules fill the registry when they are imported
    (``eval.plugins`` imports them all)."""
    return METHODS.get(name)


def method_label(settings: dict[str, Any]) -> str:
    """The name results and tables give a run of these method settings: the method's name, or
    ``<name>+<variant>`` for the first declared variant (``Method.variants``) whose settings they all have."""
    name = settings["name"]
    for variant, values in method_class(name).variants.items():
        if all(settings.get(key) == value for key, value in values.items()):
            return f"{name}+{variant}"
    return name


def method_settings(values: dict[str, Any]) -> MethodConfig:
    """The settings a method runs with: its config class's (unknown keys and wrong types refused, the settings fitted
    to the budget where the method does that), budget None for a budget-free method, and the budget held to the
    rules the settings alone decide (``MethodConfig.check_budget``)."""
    method_cls = method_class(values.get("name"))
    values = dict(values)
    if not method_cls.uses_budget:
        values["budget"] = None
    config = method_cls.config_class.from_dict(values)
    if method_cls.uses_budget:
        config.check_budget()
    return config


def build_method(values: dict[str, Any], model: ModelInfo) -> Method:
    """Config dict (from Hydra or a test) -> checked ``Method``; raises ``ConfigError`` on bad settings."""
    config = method_settings(values)
    method = method_class(config.name)(config, model)
    method.check()
    if method.uses_budget:
        config.check_min_budget(method.min_budget())
    return method
