"""One (model, method, task, budget) run: resumable, append-only, with an atomic done marker.

Output directory = ``<output_root>/<task>/<model>/<method>/budget-<b>/<hash>``: a pure function of the settings
that can change a number, so a resubmitted sweep lands in the same place. Per sample one JSON line is appended
and flushed; a restarted run skips the ids already written (a torn last line is dropped); ``metrics.json`` is
written last, atomically, and marks the run done. A run may be shared by several processes (``n_shards``), each
appending its share of the samples to a file of its own; the one that completes the run merges the files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import statistics
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval.plugins import method_class
from eval.report.bootstrap import bootstrap_intervals
from icecache.core.method import method_label
from icecache.core.models import ModelSpec, check_model, model_info
from icecache.errors import ConfigError, check_types

PREDICTIONS = "predictions.jsonl"
METRICS = "metrics.json"


def effective_method_settings(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """The method's settings as the method runs them, and what differs from those asked for.

    The settings go through the method's config class (unknown keys and wrong types are refused here, before any
    model is read), which may fit them to the budget (IceCache's fixed pages at small budgets); the run's identity,
    config.yaml and directory are made of the values returned, so they say what was attended. Budget-free methods
    get budget None: one run directory whatever budget was asked."""
    method_cls = method_class(values.get("name"))
    values = dict(values)
    if not method_cls.uses_budget:
        values["budget"] = None
    settings = method_cls.config_class.from_dict(dict(values))
    effective = {key: getattr(settings, key) for key in values}
    budget = effective.get("budget")
    if method_cls.uses_budget:
        if budget is None or budget <= 0:
            raise ConfigError(f"method {values['name']!r} needs a positive budget: add budget=<tokens>")
        page_size = getattr(settings, "page_size", None)
        if isinstance(page_size, int) and page_size > 0 and budget % page_size:
            lower, upper = budget // page_size * page_size, (budget // page_size + 1) * page_size
            raise ConfigError(
                f"budget {budget} is not a multiple of {values['name']}'s page size {page_size}: the method attends "
                f"whole pages ({lower} tokens at this budget); use budget={upper}" + (f" or {lower}" if lower else "")
            )
    adjusted = {key: (values[key], effective[key]) for key in values if values[key] != effective[key]}
    return effective, adjusted


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
        known = {f.name for f in dataclasses.fields(cls)} - {"adjusted"}
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
        if self.n_shards > 1 and not self.resume:
            raise ConfigError("resume=false restarts the whole run, which other shards may be writing: run it "
                              "with n_shards=1")

    @property
    def predictions_name(self) -> str:
        """The predictions file this process writes: the run's own, or its shard's."""
        return PREDICTIONS if self.n_shards == 1 else f"predictions.shard-{self.shard}-of-{self.n_shards}.jsonl"

    def identity(self) -> dict[str, Any]:
        """The settings that can change a result (device and dtype included, threads and paths not)."""
        model = dataclasses.asdict(self.model)
        model["device"] = str(self.model.resolved_device())
        model["dtype"] = str(self.model.resolved_dtype())
        model.pop("install_hint", None)
        identity = {"model": model, "method": self.method, "task": self.task,
                    "prefill_chunk_size": self.prefill_chunk_size}
        if self.measure_selection:
            # Only when on, so that every directory of an unmeasured run keeps its hash. A measured run is a run of
            # its own: its records carry the measurement, and its timings include the measuring.
            identity["measure_selection"] = True
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


def read_records(path: Path) -> list[dict[str, Any]]:
    """Complete JSON lines of a predictions file; a torn last line (killed mid-write) is dropped."""
    if not path.exists():
        return []
    records, seen = [], set()
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record["sample_id"] not in seen:
                seen.add(record["sample_id"])
                records.append(record)
    return records


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file of this process's own (shards of one run write the same
    files at once), renamed into place: a reader sees the old file or the new one, never part of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, payload: Any) -> None:
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True, default=str))


def _truncate_torn_tail(path: Path) -> None:
    """Drop a partial last line so the next append starts on a fresh line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as handle:
            handle.truncate(cut)


class RunLock:
    """Exclusive lock next to the predictions, so two jobs never write one predictions file (duplicate sweep points,
    one shard started twice): ``.lock`` for the run's own file, ``.lock.<shard file>`` for a shard's, and
    ``.finish.lock``, waited for (``blocking``), around merging the files and writing the metrics."""

    def __init__(self, directory: Path, name: str = ".lock", blocking: bool = False):
        self.path = directory / name
        self.blocking = blocking

    def __enter__(self):
        import fcntl

        self.handle = open(self.path, "w")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | (0 if self.blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            self.handle.close()
            raise ConfigError(f"another process is writing {self.path.parent}; wait for it or kill it") from None
        return self

    def __exit__(self, *exc):
        self.handle.close()


def predictions_files(directory: Path) -> list[Path]:
    """A run's predictions files: its own first, then its shards' in name order."""
    shards = sorted(directory.glob("predictions.shard-*-of-*.jsonl"))
    own = directory / PREDICTIONS
    return ([own] if own.exists() else []) + shards


def run_records(directory: Path) -> dict[str, dict[str, Any]]:
    """Every finished sample of a run across its predictions files, once each (the first file that holds it wins:
    two shardings of one run may have overlapped)."""
    records: dict[str, dict[str, Any]] = {}
    for path in predictions_files(directory):
        for record in read_records(path):
            records.setdefault(record["sample_id"], record)
    return records


def check_writable(root: Path) -> None:
    """Refuse an ``output_root`` that cannot hold directories, without creating anything: a probe directory is made
    and removed in the nearest existing ancestor (permission bits do not tell for root, nor for /proc or /sys)."""
    import tempfile

    ancestor = Path(root).expanduser().absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"output_root={root}: {ancestor} is a file, not a folder; choose another output_root")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".icecache-probe-", dir=ancestor))
    except OSError as error:
        raise ConfigError(f"output_root={root}: cannot create folders under {ancestor} ({error.strerror or error}); "
                          f"choose another output_root") from None


def looks_like_path(path: str) -> bool:
    """``/models/x``, ``./x``, ``~/x``, ``a/b/c``: a folder, not a hub id (``org/name``)."""
    return path.startswith(("/", "./", "../", "~")) or path.count("/") > 1


def check_model_path(spec: ModelSpec) -> None:
    """A hub model whose ``model.path`` is a folder that is not there: said before transformers is asked."""
    path = spec.path or ""
    if spec.source == "hub" and looks_like_path(path) and not Path(path).expanduser().exists():
        raise model_error(spec, FileNotFoundError(path))


def model_error(spec: ModelSpec, error: BaseException) -> ConfigError:
    """One line for a model whose config or tokenizer cannot be read (a path that is not there, no network)."""
    detail = " ".join(str(error).split()) or type(error).__name__
    detail = detail if len(detail) <= 200 else detail[:197] + "..."
    path = spec.path or ""
    if spec.source == "hub" and looks_like_path(path) and not Path(path).expanduser().exists():
        return ConfigError(
            f"model.path={path} does not exist: set model.path to a local folder with the model's config.json, "
            f"tokenizer and safetensors weights, or to a hub id"
        )
    if spec.source == "hub" and not Path(path).expanduser().exists():
        return ConfigError(
            f"could not load model {spec.name} ({path}) from the hub: {detail} -- without network, download it and "
            f"set model.path=<local folder>"
        )
    return ConfigError(f"could not read model {spec.name} ({path or spec.source}): {type(error).__name__}: {detail}")


_MODEL_READ_ERRORS = (OSError, ValueError, KeyError, ImportError, RuntimeError)


def read_model_part(spec: ModelSpec, read):
    """``read()`` (the model's config, its tokenizer), with what goes wrong reading it as one ``ConfigError``."""
    try:
        return read()
    except _MODEL_READ_ERRORS as error:
        if isinstance(error, ConfigError):
            raise
        raise model_error(spec, error) from None


# What one process computes once and may need again: the jobs of a sweep run one after another in one process
# (Hydra's local launcher, scripts/run_jobs.py), and for a GGUF model reading its geometry and converting its
# tokenizer take seconds each, building RULER's prompts at 8k tokens half a minute, loading the weights more. Each
# entry is a pure function of its key (the model's settings, the task's); runs do not change what they get.
_MEMO: dict[str, "OrderedDict[str, Any]"] = {}


def memo(kind: str, key: str, compute, keep: int = 2):
    """``compute()``, or what it gave last time for this ``kind`` and ``key``; the ``keep`` latest per kind stay,
    the oldest goes first (before computing, so that two models are never held at once with ``keep=1``)."""
    held = _MEMO.setdefault(kind, OrderedDict())
    if key in held:
        held.move_to_end(key)
        return held[key]
    while len(held) >= keep:
        held.popitem(last=False)
    held[key] = value = compute()
    return value


def model_key(config: RunConfig) -> str:
    return json.dumps(config.identity()["model"], sort_keys=True, default=str)


def prepare(config: RunConfig):
    """Every check that needs no weights, cheapest first, before anything is written: -> (task, method).

    Settings (the run's, the method's, the task's) come first, then the task's data, then the model's files, and
    last the model's config (for a GGUF file: seconds of parsing), which the method's geometry checks need."""
    from eval.plugins import build_method
    from eval.tasks.base import build_task

    config.check_settings()
    check_writable(Path(config.output_root))
    task = build_task(config.task)
    task.check_max_length(config.model.max_length)
    check_model_path(config.model)
    check_model(config.model)
    info = read_model_part(config.model, lambda: memo("model_info", model_key(config),
                                                     lambda: model_info(config.model)))
    method = build_method(config.method, info)
    return task, method


def build_samples(task, config: RunConfig):
    """(tokenizer, samples): the model's tokenizer and every sample, built before any weights load, so a task
    that cannot be built for this model (a passkey length shorter than its fixed text, a RULER length too short for
    a task) or that yields nothing stops the run before it starts."""
    from eval.tasks.base import PromptContext
    from icecache.core.models import load_tokenizer

    tokenizer = read_model_part(config.model, lambda: memo("tokenizer", model_key(config),
                                                          lambda: load_tokenizer(config.model)))
    context = PromptContext(
        tokenizer=tokenizer,
        model_name=config.model.name,
        chat_template=config.model.chat_template,
        max_length=config.model.max_length,
    )
    key = model_key(config) + json.dumps(config.task, sort_keys=True, default=str)
    samples = memo("samples", key, lambda: list(task.samples(context)), keep=4)
    if not samples:
        raise ConfigError(f"task {config.task['name']} gives no samples with these settings; a run of 0 samples "
                          f"would look finished: check task.limit and the task's data")
    return tokenizer, samples


def summarise_latency(records: list[dict[str, Any]], by_length: bool = False) -> dict[str, Any]:
    """Medians over the run's samples; with ``by_length`` (tasks with context lengths: passkey, RULER) also one
    summary per length under ``by_length``, since a median pooled over 10k and 30k prompts describes neither."""
    if by_length:
        groups: dict[Any, list[dict[str, Any]]] = {}
        for record in records:
            groups.setdefault((record.get("meta") or {}).get("length"), []).append(record)
        summary = summarise_latency(records)
        summary["by_length"] = {str(length): summarise_latency(group) for length, group in groups.items()
                                if length is not None}
        return summary

    def med(key: str):
        values = [r["gen"][key] for r in records if r.get("gen", {}).get(key) is not None]
        return statistics.median(values) if values else None

    attended = [r["gen"]["mean_attended_tokens"] for r in records if r["gen"].get("mean_attended_tokens") is not None]
    return {
        "median_ttft_s": med("ttft_s"),
        "median_tt2t_s": med("tt2t_s"),
        "median_tpot_s": med("tpot_s"),
        "mean_attended_tokens": statistics.fmean(attended) if attended else None,
        "max_peak_gpu_bytes": max((r["gen"].get("peak_gpu_bytes") or 0 for r in records), default=0) or None,
    }


def loaded_model(config: RunConfig, tokenizer):
    """(model, tokenizer) of ``config.model``, loaded once per process while the model's settings stay the same."""
    from icecache.core.cache import ATTENTION_NAME
    from icecache.core.models import load_model

    return memo("model", model_key(config), lambda: load_model(config.model, ATTENTION_NAME, tokenizer=tokenizer),
                keep=1)


def summarise_selection(records: list[dict[str, Any]], by_length: bool = False) -> dict[str, Any] | None:
    """The selection-quality diagnostic over a run's measured samples: per sparsified layer, the mean over samples
    of each sample's means (mass the attended set holds, mass of the best set of the same size, tokens attended),
    and their means over layers; with ``by_length``, the same per context length. None when nothing was measured."""
    rows = [r for r in records if r.get("selection")]
    if not rows:
        return None
    if by_length:
        groups: dict[Any, list[dict[str, Any]]] = {}
        for record in rows:
            groups.setdefault((record.get("meta") or {}).get("length"), []).append(record)
        summary = summarise_selection(rows)
        summary["by_length"] = {str(length): summarise_selection(group) for length, group in groups.items()
                                if length is not None}
        return summary
    layers = rows[0]["selection"]["layers"]
    out: dict[str, Any] = {"layers": layers, "n_samples": len(rows)}
    for key, digits in (("mass", 6), ("oracle_mass", 6), ("attended", 3)):
        per_layer = [round(statistics.fmean(r["selection"][key][i] for r in rows), digits)
                     for i in range(len(layers))]
        out[key] = per_layer
        out[f"mean_{key}"] = round(statistics.fmean(per_layer), digits)
    return out


def run(config: RunConfig) -> dict[str, Any] | None:
    import torch
    from omegaconf import OmegaConf
    from tqdm.auto import tqdm

    from eval import provenance
    from icecache.core.cache import HarnessCache
    from icecache.core.generation import GenerationRequest, default_eos_token_ids, greedy_generate
    from icecache.core.timing import PhaseTimer

    task, method = prepare(config)
    out_dir = config.output_dir()
    metrics_path = out_dir / METRICS
    if config.resume and metrics_path.exists():
        print(f"already done: {metrics_path}")
        return json.loads(metrics_path.read_text())
    if config.adjusted:
        used = ", ".join(f"{key}={new} (asked: {old})" for key, (old, new) in config.adjusted.items())
        print(f"note: {config.method['name']} at budget {config.method.get('budget')} runs with {used}; "
              f"config.yaml records it (docs/eval.md, IceCache at small budgets)", file=sys.stderr)
    tokenizer, samples = build_samples(task, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    if config.threads is not None:
        torch.set_num_threads(config.threads)

    sharded = config.n_shards > 1
    lock_name = ".lock" if not sharded else f".lock.{config.predictions_name}"
    with RunLock(out_dir, lock_name):
        predictions_path = out_dir / config.predictions_name
        if not config.resume and predictions_path.exists():
            predictions_path.unlink()
        _truncate_torn_tail(predictions_path)
        write_text_atomic(out_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(config.identity())))
        write_json_atomic(out_dir / "env.json", provenance.collect())

        model, tokenizer = loaded_model(config, tokenizer)
        done = set(run_records(out_dir))
        mine = samples[config.shard :: config.n_shards]
        todo = [s for s in mine if s.sample_id not in done]
        default_eos = default_eos_token_ids(tokenizer, getattr(model, "generation_config", None))
        shard_label = f" (shard {config.shard + 1}/{config.n_shards})" if sharded else ""
        with open(predictions_path, "a", encoding="utf-8") as sink:
            for sample in tqdm(todo, desc=f"{config.task['name']} / {config.method['name']}{shard_label}",
                               initial=len(mine) - len(todo), total=len(mine)):
                cache = HarnessCache(method, PhaseTimer(config.model.resolved_device(), config.measure_phases),
                                     measure_selection=config.measure_selection)
                request = GenerationRequest(
                    input_ids=sample.input_ids,
                    max_new_tokens=sample.max_new_tokens,
                    eos_token_ids=sample.eos_token_ids if sample.eos_token_ids is not None else default_eos,
                    min_new_tokens=sample.min_new_tokens,
                    stop_strings=sample.stop_strings,
                    suffix_ids=sample.suffix_ids,
                )
                result = greedy_generate(
                    model, cache, request, prefill_chunk_size=config.prefill_chunk_size, tokenizer=tokenizer,
                    layer_by_layer=config.layer_by_layer_prefill, residual_on_host=config.prefill_residual_on_host,
                )
                prediction = tokenizer.decode(result.token_ids, skip_special_tokens=True)
                record = {
                    "sample_id": sample.sample_id,
                    "prediction": prediction,
                    "output_ids": result.token_ids,
                    "answers": sample.answers,
                    **task.score(sample, prediction, result.token_ids),
                    "meta": sample.meta,
                    "gen": result.summary(),
                }
                if result.selection is not None:
                    record["selection"] = result.selection
                sink.write(json.dumps(record, default=str) + "\n")
                sink.flush()
                os.fsync(sink.fileno())
                cache.close()  # ends the method's workers now, not when the garbage collector runs
        if not sharded:
            return finish(config, task, samples, holds_run_lock=True)
    return finish(config, task, samples, holds_run_lock=False)


def finish(config: RunConfig, task, samples, holds_run_lock: bool) -> dict[str, Any] | None:
    """The run's metrics.json once every sample is in, else None (a shard whose part is done while others are
    not). Shards' files are merged into the run's predictions.jsonl, in sample order, first. One process at a time
    (``.finish.lock``); a shard leaves the run to the unsharded process that is writing it, if there is one."""
    from eval import provenance

    out_dir = config.output_dir()
    metrics_path = out_dir / METRICS
    with RunLock(out_dir, ".finish.lock", blocking=True), contextlib.ExitStack() as held:
        if metrics_path.exists():
            return json.loads(metrics_path.read_text())
        if not holds_run_lock:
            try:
                held.enter_context(RunLock(out_dir, ".lock"))
            except ConfigError:
                return None  # an unsharded process is writing the run; it finishes it
        found = run_records(out_dir)
        if any(s.sample_id not in found for s in samples):
            return None
        records = [found[s.sample_id] for s in samples]
        shard_files = [path for path in predictions_files(out_dir) if path.name != PREDICTIONS]
        if shard_files:
            write_text_atomic(out_dir / PREDICTIONS, "".join(json.dumps(r, default=str) + "\n" for r in records))
            for path in shard_files:
                path.unlink()
        by_length = "lengths" in config.task
        metrics = {
            "task": config.task["name"],
            "model": config.model.name,
            "method": config.method["name"],
            "method_label": method_label(config.method),  # the name tables give it (a variant's own)
            "budget": config.method.get("budget"),
            "config_hash": config.config_hash(),
            "n_samples": len(records),
            "metrics": task.aggregate(records),
            "confidence": bootstrap_intervals(records, task.aggregate),
            "latency": summarise_latency(records, by_length=by_length),
            "settings": config.identity(),
            "provenance": provenance.collect(),
        }
        selection = summarise_selection(records, by_length=by_length)
        if selection is not None:
            metrics["selection"] = selection
        write_json_atomic(metrics_path, metrics)
        return metrics


def main_from_dict(values: dict[str, Any], exit_on_error: bool = True) -> dict[str, Any] | None:
    """CLI wrapper: runs, then says the score and where the results are. A ``ConfigError`` becomes one line on
    stderr and exit code 2, or, with ``exit_on_error=False`` (one job of a sweep), that line and None."""
    try:
        config = RunConfig.from_dict(values)
        metrics = run(config)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        if exit_on_error:
            sys.exit(2)
        return None
    if metrics is None:
        print(f"shard {config.shard + 1} of {config.n_shards}: its samples are done; the run's metrics.json comes "
              f"with the last shard to finish ({config.output_dir()})")
        return None
    print(f"{metrics['task']} / {metrics['method']} / budget {metrics['budget']}: {metrics['metrics']}")
    print(f"results: {config.output_dir()} ({PREDICTIONS}, {METRICS}, config.yaml)")
    return metrics
