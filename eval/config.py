"""A run's settings (``RunConfig``): what it runs, checked at once, and the identity that names its directory.

Output directory = ``<output_root>/<task>/<model>/<method>/budget-<b>/<hash>``: a pure function of the settings
that can change a number (``RunConfig.identity``), so a resubmitted sweep lands in the same place and a run resumes.
The identity, its hash and the directory must stay byte for byte what they are: finished and half-finished runs on
disk are found by them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval import rundir
from eval.plugins import method_class
from icecache.core.method import method_settings, run_identity
from icecache.core.models import ModelSpec
from icecache.errors import ConfigError, check_types, unknown_keys_message


def effective_method_settings(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """The method's settings as the method runs them, and what differs from those asked for.

    The settings go through the method's config class (``method_settings``: unknown keys, wrong types and a budget
    the method cannot run are refused here, before any model is read), which may fit them to the budget (IceCache's
    fixed pages at small budgets); the run's identity, config.yaml and directory are made of the values returned, so
    they say what was attended. Budget-free methods get budget None: one run directory whatever budget was asked."""
    values = dict(values)
    if not method_class(values.get("name")).uses_budget:
        values["budget"] = None
    settings = method_settings(values)
    effective = {key: getattr(settings, key) for key in values}
    adjusted = {key: (values[key], effective[key]) for key in values if values[key] != effective[key]}
    return effective, adjusted


# Top-level keys that are not the run's own settings but values its parts read (configs/method/*.yaml have
# ``budget: ${budget}``): kept in ``RunConfig.extra``.
SHARED_KEYS = ("budget",)


def check_one_budget(values: dict[str, Any]) -> None:
    """``budget=256 method.budget=128`` asks for two budgets; the run would use the method's without a word."""
    method = values.get("method") or {}
    if "budget" in values and "budget" in method and values["budget"] != method["budget"]:
        raise ConfigError(f"budget={values['budget']} and method.budget={method['budget']} conflict: set the budget "
                          f"once, with budget=<tokens> (every method reads it)")


@dataclass
class RunConfig:
    model: ModelSpec
    method: dict[str, Any]
    task: dict[str, Any]
    output_root: str = "results/runs"
    prefill_chunk_size: int | None = None
    layer_by_layer_prefill: bool = False  # same result; bounds prefill memory (generation._prefill_layer_by_layer)
    prefill_residual_on_host: bool = False  # with layer_by_layer_prefill: the residual stream in host memory
    threads: int | None = None
    measure_phases: bool = False
    # The selection-quality diagnostic (icecache.core.selection_quality): every decode step of the sparsified
    # layers measured against its exact attention; generates the same tokens.
    measure_selection: bool = False
    # Samples decoded together, each with its own cache and selection (icecache.core.batch). The model's matrix
    # products then run over the batch, which may round differently from one sample alone, so a batched run is a
    # run of its own; every batch is filled to batch_size (the last with copies of its first sample, whose output
    # is dropped), so that a sample's tokens do not depend on where a shard or a resumed run starts its batches.
    batch_size: int = 1
    resume: bool = True
    # This process's share of the run's samples: the samples at positions shard, shard + n_shards, ... Processes
    # that share a run this way write a predictions file each, and whichever completes the run's last sample merges
    # them into one; the run and its directory are the same whatever the sharding (not part of the identity).
    shard: int = 0
    n_shards: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    adjusted: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # method settings fitted to the budget

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "RunConfig":
        """Settings -> RunConfig, refusing at once (``ConfigError``) what the settings alone show to be wrong."""
        values = dict(values)
        known = {f.name for f in dataclasses.fields(cls)} - {"adjusted", "extra"}
        unknown = sorted(set(values) - known - set(SHARED_KEYS))
        if unknown:
            raise ConfigError(unknown_keys_message("the run", unknown, known | set(SHARED_KEYS),
                                                   "; model.*, method.* and task.* hold the rest"))
        check_one_budget(values)
        extra = {k: values.pop(k) for k in list(values) if k not in known}
        check_types(cls, {k: v for k, v in values.items() if k not in ("model", "method", "task")}, "")
        method, adjusted = effective_method_settings(dict(values.pop("method")))
        config = cls(model=ModelSpec.from_dict(dict(values.pop("model"))), method=method, extra=extra,
                     adjusted=adjusted, **values)
        config.check_settings()
        return config

    def check_settings(self) -> None:
        """The run's own settings (the method's and the task's have their checks)."""
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads={self.threads} must be at least 1 (or null for torch's default)")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size <= 0:
            raise ConfigError("prefill_chunk_size must be positive or null")
        if self.prefill_residual_on_host and not self.layer_by_layer_prefill:
            raise ConfigError("prefill_residual_on_host=true needs layer_by_layer_prefill=true")
        if not str(self.output_root).strip():
            raise ConfigError("output_root is empty: give a folder, e.g. output_root=results/runs")
        if self.n_shards < 1 or not 0 <= self.shard < self.n_shards:
            raise ConfigError(f"shard={self.shard} of n_shards={self.n_shards}: n_shards must be at least 1 and "
                              f"shard one of 0..n_shards-1")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size} must be at least 1 (samples decoded together)")
        if self.batch_size > 1 and (self.measure_selection or self.measure_phases):
            setting = "measure_selection" if self.measure_selection else "measure_phases"
            raise ConfigError(f"{setting}=true measures one sample's decode steps, and batch_size={self.batch_size} "
                              f"decodes several in one step: run it with batch_size=1")
        if self.n_shards > 1 and not self.resume:
            raise ConfigError("resume=false restarts the whole run, which other shards may be writing: run it "
                              "with n_shards=1")

    @property
    def predictions_name(self) -> str:
        """The predictions file this process writes: the run's own, or its shard's."""
        return rundir.predictions_name(self.shard, self.n_shards)

    def identity(self) -> dict[str, Any]:
        """The settings that can change a result (device and dtype included, threads, paths and the method's
        ``not_in_run_identity`` fields not, nor the ``in_run_identity_unless_default`` ones at their default)."""
        model = dataclasses.asdict(self.model)
        model["device"] = str(self.model.resolved_device())
        model["dtype"] = str(self.model.resolved_dtype())
        model.pop("install_hint", None)
        method = run_identity(method_class(self.method["name"]).config_class, self.method)
        identity = {"model": model, "method": method, "task": self.task,
                    "prefill_chunk_size": self.prefill_chunk_size}
        if self.measure_selection:
            # Only when on, so that every directory of an unmeasured run keeps its hash. A measured run is a run of
            # its own: its records carry the measurement, and its timings include the measuring.
            identity["measure_selection"] = True
        if self.batch_size > 1:  # likewise: batch-1 runs keep their hashes
            identity["batch_size"] = self.batch_size
        return identity

    def config_hash(self) -> str:
        canonical = json.dumps(self.identity(), sort_keys=True, default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()[:10]

    def output_dir(self) -> Path:
        budget = self.method.get("budget")
        budget_part = "budget-none" if budget is None else f"budget-{budget}"
        return (
            Path(self.output_root) / self.task["name"] / self.model.name / self.method["name"] / budget_part
            / self.config_hash()
        )
