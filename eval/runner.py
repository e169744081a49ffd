"""One (model, method, task, budget) run: prepare, build the samples, generate, score, finish.

The run's settings and directory are ``eval.config.RunConfig``'s; what it writes there, and how a killed run resumes
and a sharded run merges, is ``eval.rundir``'s format. A run appends one line per sample and writes
``metrics.json`` last; a restarted run skips the samples already written.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

from eval import rundir
from eval.config import RunConfig
from eval.models import check_model_path, read_model_part
from eval.report.bootstrap import bootstrap_intervals
from icecache.core.method import method_label
from icecache.core.models import check_model, model_info
from icecache.errors import ConfigError

__all__ = ["RunConfig", "build_samples", "finish", "main_from_dict", "prepare", "run"]


# What one process computes once and may need again: the jobs of a sweep run one after another in one process
# (Hydra's local launcher, scripts/sweep.py), and for a GGUF model reading its geometry and converting its
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
    rundir.check_writable(Path(config.output_root))
    task = build_task(config.task)
    task.check_max_length(config.model.max_length)
    check_model_path(config.model)
    check_model(config.model)
    info = read_model_part(config.model, lambda: memo("model_info", model_key(config),
                                                     lambda: model_info(config.model)))
    check_positions(task, config, info.max_positions)
    method = build_method(config.method, info)
    method.check_batch_size(config.batch_size)
    return task, method


def check_positions(task, config: RunConfig, positions: int | None) -> None:
    """A prompt past the positions the model declares would run on positions it never saw, and score as if it were
    a fair run: refuse the task's lengths (or LongBench's truncation length) past them. ``model.max_length`` alone
    above them is not refused, since a task may ask for less."""
    if positions is None or positions >= config.model.max_length:
        return
    try:
        task.check_max_length(positions)
    except ConfigError:
        raise ConfigError(
            f"the task asks for prompts longer than the {positions} positions of model {config.model.name} "
            f"(max_position_embeddings in its config; model.max_length={config.model.max_length} is past them too): "
            f"lower the task's lengths, or set model.config.max_position_embeddings=<n> to run past them on purpose"
        ) from None


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
    """The run of ``config``: its metrics, or None for a shard whose part is done while the run is not."""
    import torch
    from omegaconf import OmegaConf
    from tqdm.auto import tqdm

    from eval import provenance
    from icecache.core.generation import default_eos_token_ids

    task, method = prepare(config)
    out_dir = config.output_dir()
    if config.resume and (metrics := rundir.done_metrics(out_dir)) is not None:
        print(f"already done: {out_dir / rundir.METRICS}")
        return metrics
    if config.adjusted:
        used = ", ".join(f"{key}={new} (asked: {old})" for key, (old, new) in config.adjusted.items())
        print(f"note: {config.method['name']} at budget {config.method.get('budget')} runs with {used}; "
              f"config.yaml records it (docs/eval.md, IceCache at small budgets)", file=sys.stderr)
    tokenizer, samples = build_samples(task, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    if config.threads is not None:
        torch.set_num_threads(config.threads)

    sharded = config.n_shards > 1
    with rundir.RunLock(out_dir, rundir.lock_name(config.predictions_name)):
        predictions_path = out_dir / config.predictions_name
        if not config.resume and predictions_path.exists():
            print(f"restarting {out_dir} (resume=false): its {len(rundir.read_records(predictions_path))} written "
                  f"samples are dropped")
            predictions_path.unlink()
        rundir.truncate_torn_tail(predictions_path)
        environment = provenance.collect()
        check_same_dci_kernels(out_dir, predictions_path, environment)
        rundir.write_text_atomic(out_dir / rundir.CONFIG, OmegaConf.to_yaml(OmegaConf.create(config.identity())))
        rundir.write_json_atomic(out_dir / rundir.ENV, environment)

        model, tokenizer = loaded_model(config, tokenizer)
        done = set(rundir.run_records(out_dir))
        mine = samples[config.shard :: config.n_shards]
        todo = [s for s in mine if s.sample_id not in done]
        if len(todo) < len(mine):
            print(f"resuming {out_dir}: {len(mine) - len(todo)} of {len(mine)} samples already written, "
                  f"{len(todo)} to run")
        default_eos = default_eos_token_ids(tokenizer, getattr(model, "generation_config", None))
        shard_label = f" (shard {config.shard + 1}/{config.n_shards})" if sharded else ""
        with open(predictions_path, "a", encoding="utf-8") as sink, \
                tqdm(desc=f"{config.task['name']} / {config.method['name']}{shard_label}",
                     initial=len(mine) - len(todo), total=len(mine)) as progress:
            for start in range(0, len(todo), config.batch_size):
                group = todo[start : start + config.batch_size]
                if config.batch_size == 1:
                    records = [run_sample(config, task, method, model, tokenizer, group[0], default_eos)]
                else:
                    records = run_batch(config, task, method, model, tokenizer, group, default_eos)
                for record in records:  # a batch's lines go in together: a killed run redoes the whole batch
                    rundir.append_record(sink, record)
                progress.update(len(records))
        if not sharded:
            return finish(config, task, samples, holds_run_lock=True)
    return finish(config, task, samples, holds_run_lock=False)


def check_same_dci_kernels(out_dir: Path, predictions_path: Path, environment: dict[str, Any]) -> None:
    """A run resumes with the DCI kernels' instruction set its written samples were made with: another one sums a
    search's scores in another order (docs/dci.md, kernels), so one run would mix two arithmetics. Runs recorded
    before the set was (no ``dci_isa``) resume as they are."""
    env_path = out_dir / rundir.ENV
    if not (env_path.exists() and rundir.read_records(predictions_path)):
        return
    before, now = json.loads(env_path.read_text(encoding="utf-8")).get("dci_isa"), environment.get("dci_isa")
    if before and now and before != now and "unavailable" not in f"{before}{now}":
        raise ConfigError(f"{out_dir}: its samples were made with the DCI kernels' {before} instruction set and this "
                          f"process has {now}: resume with ICECACHE_DCI_ISA={before}, or restart it with resume=false")


def generation_request(sample, default_eos):
    """What generating ``sample`` asks for; the model's EOS ids where the task gives none."""
    from icecache.core.generation import GenerationRequest

    return GenerationRequest(
        input_ids=sample.input_ids,
        max_new_tokens=sample.max_new_tokens,
        eos_token_ids=sample.eos_token_ids if sample.eos_token_ids is not None else default_eos,
        min_new_tokens=sample.min_new_tokens,
        stop_strings=sample.stop_strings,
        suffix_ids=sample.suffix_ids,
    )


def run_sample(config: RunConfig, task, method, model, tokenizer, sample, default_eos) -> dict[str, Any]:
    """One sample generated greedily with a fresh cache of the method, and scored: its predictions line."""
    from icecache.core.cache import HarnessCache
    from icecache.core.generation import greedy_generate
    from icecache.core.timing import PhaseTimer

    # Closed when the generation ends (an error included): its workers end now, not when the garbage collector
    # runs, and its host buffers go back to the method's pool.
    with HarnessCache(method, PhaseTimer(config.model.resolved_device(), config.measure_phases),
                      measure_selection=config.measure_selection) as cache:
        result = greedy_generate(
            model, cache, generation_request(sample, default_eos), prefill_chunk_size=config.prefill_chunk_size,
            tokenizer=tokenizer, layer_by_layer=config.layer_by_layer_prefill,
            residual_on_host=config.prefill_residual_on_host,
        )
    return sample_record(task, tokenizer, sample, result)


def run_batch(config: RunConfig, task, method, model, tokenizer, samples, default_eos) -> list[dict[str, Any]]:
    """``samples`` decoded together (``config.batch_size`` rows, the missing ones copies of the first sample, whose
    output is dropped), each with a fresh cache of the method, and scored: their predictions lines, in order."""
    from icecache.core.batched_generation import batched_greedy_generate

    requests = [generation_request(sample, default_eos) for sample in samples]
    requests += [generation_request(samples[0], default_eos) for _ in range(config.batch_size - len(samples))]
    rows, batch = batched_greedy_generate(
        model, method, requests, tokenizer=tokenizer, prefill_chunk_size=config.prefill_chunk_size,
        layer_by_layer=config.layer_by_layer_prefill, residual_on_host=config.prefill_residual_on_host,
    )
    return [sample_record(task, tokenizer, sample, row.result(batch)) for sample, row in zip(samples, rows)]


def sample_record(task, tokenizer, sample, result) -> dict[str, Any]:
    """A generated sample, scored: its predictions line."""
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
    return record


def finish(config: RunConfig, task, samples, holds_run_lock: bool) -> dict[str, Any] | None:
    """The run's metrics.json once every sample is in, else None (a shard whose part is done while others are
    not). Shards' files are merged into the run's predictions.jsonl, in sample order, first. One process at a time
    (``.finish.lock``); a shard leaves the run to the unsharded process that is writing it, if there is one."""
    from eval import provenance

    out_dir = config.output_dir()
    with rundir.RunLock(out_dir, rundir.FINISH_LOCK, blocking=True), contextlib.ExitStack() as held:
        if (metrics := rundir.done_metrics(out_dir)) is not None:
            return metrics
        if not holds_run_lock:
            try:
                held.enter_context(rundir.RunLock(out_dir, rundir.RUN_LOCK))
            except ConfigError:
                return None  # an unsharded process is writing the run; it finishes it
        found = rundir.run_records(out_dir)
        if any(s.sample_id not in found for s in samples):
            return None
        records = [found[s.sample_id] for s in samples]
        shard_files = rundir.shard_files(out_dir)
        if shard_files:
            rundir.write_records(out_dir / rundir.PREDICTIONS, records)
            for path in shard_files:
                path.unlink()
        by_length = task.has_lengths
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
        data = task.data_record()
        if data is not None:  # only for tasks that read a data file: other results keep their keys
            metrics["data"] = data
        selection = summarise_selection(records, by_length=by_length)
        if selection is not None:
            metrics["selection"] = selection
        rundir.write_json_atomic(out_dir / rundir.METRICS, metrics)
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
    print(f"results: {config.output_dir()} ({rundir.PREDICTIONS}, {rundir.METRICS}, {rundir.CONFIG})")
    return metrics
