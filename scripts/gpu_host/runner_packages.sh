# Sourced by the one-call GPU-host scripts (latency.sh, throughput.sh, search_profile.sh) before they build anything:
# the benchmarks import the runner (Hydra, the tasks' scorers), which the host's image lacks. Installed already
# (stage.sh install, or an earlier call of this one to the same warm host): nothing to do. Else the wheels carried
# in .parts/w (scripts/gpu_host/pack.sh; carry: .parts/w, about 30 MB) are kept and installed by stage.sh, with no
# model asked for, into the stage's site folder, which PYTHONPATH then names. Neither: one line that says what to
# carry, and the script stops.
export PYTHONPATH=${ICECACHE_STAGE:-/tmp/icecache-stage}/site${PYTHONPATH:+:$PYTHONPATH}
runner_imports="import hydra, omegaconf, jieba, rouge, fuzzywuzzy, wonderwords"
if ! python3 -c "$runner_imports" >/dev/null 2>&1; then
    if ls .parts/w/*.whl >/dev/null 2>&1; then
        bash scripts/gpu_host/stage.sh keep .parts/w >/dev/null &&
            SMOLLM2=0 QWEN= bash scripts/gpu_host/stage.sh install >/dev/null 2>&1
    fi
    python3 -c "$runner_imports" >/dev/null 2>&1 || {
        echo "error: the runner's packages are missing on this host: carry .parts/w (made by scripts/gpu_host/pack.sh)"
        exit 2
    }
fi
