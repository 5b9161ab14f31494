#!/usr/bin/env bash
# The GPU benchmarks (CUDA or ROCm) in one call of under 10 minutes, results under OUT_DIR:
#   1. bench/compare.py on the device: usaf vs PEFT LoRA, full fine-tuning, inference (demo model + random
#      Qwen3-MoE-shaped model), compare-<date>.{md,json,png};
#   2. bench/gpu_offload.py --plan: a Qwen3-30B-A3B-shaped model, random weights made on the device, trained at
#      seq 2048 with the storage, cache and density usaf's autos choose for an emulated 12 GB device (the
#      configuration `usaf plan --simulate` rehearses; its experts in pinned host memory), the measured device peak
#      against the planned one, offload-<date>.{md,json};
#   3. bench/scale.py: the scale configuration (Qwen3-30B-A3B's layer shapes at a few layer counts, seq 512, experts
#      in host memory, default density) under the same emulated 12 GB budget, host peak against the planner, and a
#      bf16 correctness check against transformers on the device (logits, value gradients),
#      scale-device-<date>.{md,json}.
# The three logs go to one OUT_DIR/gpu.log. At most 8 files in all (3 + 2 + 2 + the log): a device tool returns a
# limited number of files per call, and this keeps every result within it.
#
#   bash bench/gpu.sh OUT_DIR            # on the device
#   bash bench/gpu.sh OUT_DIR --dry-run  # everything but the device: CPU, tiny shapes (tests/package/test_bench_scripts.py)
#
# A lent machine with more than one GPU: a call of its own (its files count against the same 8),
#   bash bench/gpu.sh OUT_DIR --multi-gpu [--dry-run]
# runs bench/distributed.py with one process per GPU on NCCL (RCCL on ROCm), 1 and all devices: bytes all-reduced
# per step and step time, usaf against PEFT LoRA and full fine-tuning under DDP, distributed-<date>.{md,json}
# (--dry-run: 2 gloo processes on the CPU, tiny shapes).
#
# Launches, a call of its own (3 files: launches-<date>.{md,json} and the log; it would not fit the 8 above):
#   bash bench/gpu.sh OUT_DIR --launches [--dry-run]
# runs bench/launches.py --device cuda --speed: top-level aten ops and host syncs per layer-step at Qwen3-30B-A3B's
# layer shape (E 32/64/128, densities 0.5/1/4 %, fp32/bf16, unquantized/nf4 with host residency; counted by
# torch.profiler and a TorchFunctionMode, no device synchronisation added) against issue 22's targets, and
# tokens/s at that shape (2 layers, E=128, bf16, CUDA events, median after a warm-up) of the usaf step, the
# transformers inference forward (grouped_mm, no grad) and a PEFT LoRA step. LAUNCHES_TIMEOUT (default 540 s);
# LAUNCHES_ARGS replaces the grid's arguments (e.g. "--experts 32,128 --densities 1"). Rows are written as they
# are measured, so a run stopped by the timeout keeps what it measured.
#
# Python: $PYTHON, else .venv/bin/python, else python3. usaf is imported from this checkout's src/. Wheels in
# .whl/ (e.g. peft, bitsandbytes, a transformers >= 5.24 for a machine that lacks them) are installed into a
# scratch folder first. Phase time limits: COMPARE_TIMEOUT (default 270 s), OFFLOAD_TIMEOUT (default 150 s),
# SCALE_TIMEOUT (default 150 s); SCALE_LAYERS (default "2 8") the scale run's layer counts.
set -uo pipefail

usage() { echo "usage: bash bench/gpu.sh OUT_DIR [--multi-gpu | --launches] [--dry-run]" >&2; exit 2; }
[[ $# -ge 1 && "$1" != --* ]] || usage
OUT=$1
shift
DRY_RUN=0
MULTI_GPU=0
LAUNCHES=0
for flag in "$@"; do
    case $flag in
        --dry-run) DRY_RUN=1 ;;
        --multi-gpu) MULTI_GPU=1 ;;
        --launches) LAUNCHES=1 ;;
        *) usage ;;
    esac
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$REPO"

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/usaf-bench-site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/usaf-bench-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error

# What is there, and whether it is enough: printed first, so that a failed run says why.
"$PY" - "$DRY_RUN" <<'EOF' || exit 1
import importlib, importlib.metadata, sys
dry = sys.argv[1] == "1"
from packaging.version import Version
versions = {"python": sys.version.split()[0]}
for name in ("torch", "transformers", "peft", "bitsandbytes"):
    try:
        versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        versions[name] = "MISSING"
try:
    versions["usaf"] = importlib.import_module("usaf").__version__  # from src/: imports torch and transformers
except Exception as err:  # noqa: BLE001 - report whatever breaks the import
    versions["usaf"] = f"MISSING ({type(err).__name__}: {err})"
gpu = False
if not dry:  # the device question costs a CUDA initialisation: only where it matters
    import torch
    gpu = torch.cuda.is_available()
    versions["device"] = torch.cuda.get_device_name(0) if gpu else "none"
    versions["backend"] = f"rocm {torch.version.hip}" if getattr(torch.version, "hip", None) else f"cuda {torch.version.cuda}"
print("gpu.sh:", ", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)
problems = []
if versions["transformers"].startswith("MISSING") or Version(versions["transformers"]) < Version("5.24"):
    problems.append("usaf needs transformers >= 5.24 (carry its wheel in .whl/)")
for name in ("peft", "usaf"):
    if versions[name].startswith("MISSING"):
        problems.append(f"{name} is missing (carry its wheel in .whl/)")
if versions["bitsandbytes"].startswith("MISSING"):
    print("gpu.sh: no bitsandbytes: nf4 rows fall back to usaf's int4", flush=True)
if not dry and not gpu:
    problems.append("no CUDA/ROCm device visible to torch (use --dry-run for the CPU check)")
if problems:
    print("gpu.sh: cannot run:", "; ".join(problems), file=sys.stderr)
    sys.exit(1)
EOF

status=0
LOG="$OUT/gpu.log"
: >"$LOG"
if [[ $LAUNCHES -eq 1 ]]; then
    if [[ $DRY_RUN -eq 1 ]]; then
        OMP_NUM_THREADS=1 timeout "${LAUNCHES_TIMEOUT:-300}" "$PY" bench/launches.py --quick --speed --out "$OUT" \
            2>&1 | tee -a "$LOG" || status=1
    else
        # shellcheck disable=SC2086  # LAUNCHES_ARGS is a list of arguments
        timeout "${LAUNCHES_TIMEOUT:-540}" "$PY" bench/launches.py --device cuda --speed ${LAUNCHES_ARGS:-} \
            --out "$OUT" 2>&1 | tee -a "$LOG" || status=1
    fi
elif [[ $MULTI_GPU -eq 1 ]]; then
    if [[ $DRY_RUN -eq 1 ]]; then
        OMP_NUM_THREADS=1 timeout "${DISTRIBUTED_TIMEOUT:-300}" "$PY" bench/distributed.py --smoke --worlds 1,2 \
            --out "$OUT" 2>&1 | tee -a "$LOG" || status=1
    else
        GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
        if [[ $GPUS -lt 2 ]]; then
            echo "gpu.sh: --multi-gpu needs at least 2 GPUs; torch sees $GPUS" | tee -a "$LOG"
            exit 1
        fi
        timeout "${DISTRIBUTED_TIMEOUT:-540}" "$PY" bench/distributed.py --device cuda --worlds "1,$GPUS" \
            --out "$OUT" 2>&1 | tee -a "$LOG" || status=1
    fi
elif [[ $DRY_RUN -eq 1 ]]; then
    timeout "${COMPARE_TIMEOUT:-300}" "$PY" bench/compare.py --smoke --device cpu --out "$OUT" \
        2>&1 | tee -a "$LOG" || status=1
    timeout "${OFFLOAD_TIMEOUT:-180}" "$PY" bench/gpu_offload.py --dry-run --plan --out "$OUT" \
        2>&1 | tee -a "$LOG" || status=1
    timeout "${SCALE_TIMEOUT:-180}" "$PY" bench/scale.py --dry-run --correctness --out "$OUT" \
        2>&1 | tee -a "$LOG" || status=1
else
    timeout "${COMPARE_TIMEOUT:-270}" "$PY" bench/compare.py --device cuda --parallel-start 4 --out "$OUT" \
        2>&1 | tee -a "$LOG" || status=1
    timeout "${OFFLOAD_TIMEOUT:-150}" "$PY" bench/gpu_offload.py --plan --seq 2048 --batch 1 --out "$OUT" \
        2>&1 | tee -a "$LOG" || status=1
    # shellcheck disable=SC2086  # SCALE_LAYERS is a list of counts
    timeout "${SCALE_TIMEOUT:-150}" "$PY" bench/scale.py --device cuda --budget-gb 12 --layers ${SCALE_LAYERS:-2 8} \
        --correctness --out "$OUT" 2>&1 | tee -a "$LOG" || status=1
fi
files=$(find "$OUT" -maxdepth 1 -type f | wc -l)
if [[ $files -gt 8 ]]; then
    echo "gpu.sh: $files files in $OUT, more than the 8 a device call returns" | tee -a "$LOG"
    status=1
fi
echo "gpu.sh: results in $OUT (exit $status)"
exit $status
