#!/usr/bin/env bash
# The GPU check of issue 18: everything that needs a GPU, in under 8 minutes, into ONE results file.
#
#   bash benchmarks/gpu_check.sh                          # on a CUDA machine; results -> $OUT/gpu_check.txt or ./gpu_check.txt
#   bash benchmarks/gpu_check.sh --out /tmp/gpu.txt       # results file of your choice
#   bash benchmarks/gpu_check.sh --device cpu --tiny      # dry run on a CPU with tiny shapes (~2 min on 2 cores)
#
# Sections (each timed, each with its own time limit; a failure is recorded and the next section still runs):
#   header  torch / CUDA / GPU name / driver, git commit
#   bnb     bitsandbytes importable (pip-installed if missing; offline: BNB_WHEEL_DIR=<folder with the wheel>)
#   a       benchmarks/bench_codi_model.py --device cuda --batch 32 --dtype bf16 (batched CodiModel vs the oracle)
#   b       benchmarks/bench_decoding.py --device cuda: explicit vs latent decoding, batched vs one at a time
#   c       100 codi steps on the Qwen2.5-Coder-0.5B-shaped random model, bf16, paged 8-bit AdamW, batch 8,
#           ~512 tokens/example (benchmarks/bench_memory.py): losses finite, s/step, share of weights updated
#   d       peak memory at batch 8, ~2048 tokens/example, bf16, paged 8-bit AdamW, with and without teacher
#           checkpointing: torch.cuda.max_memory_allocated (bench_memory.py) and nvidia-smi's memory.used
#           (sampled every 200 ms during every section; paged optimizer states show only there)
# Environment: PYTHON (default .venv/bin/python, else python), BNB_WHEEL_DIR, OUT.
# Exit status: 0 when no section failed (a SKIP is not a failure), 1 otherwise.
set -euo pipefail

DEVICE=cuda
TINY=0
RESULTS="${OUT:+$OUT/}gpu_check.txt"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --tiny) TINY=1; shift ;;
    --out) RESULTS="$2"; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$DEVICE" == cuda || "$DEVICE" == cpu ]] || { echo "gpu_check.sh: --device cuda|cpu" >&2; exit 2; }
if [[ "$DEVICE" == cpu && $TINY == 0 ]]; then
  echo "gpu_check.sh: --device cpu without --tiny runs the real 0.5B shapes on the CPU (hours); add --tiny" >&2
  exit 2
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$(dirname "$RESULTS")"
RESULTS="$(cd "$(dirname "$RESULTS")" && pwd)/$(basename "$RESULTS")"
cd "$ROOT"
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"; elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python; fi
export DVC_NO_ANALYTICS=1 PYTHONUNBUFFERED=1
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
: > "$RESULTS"
T_ALL=$(date +%s.%N)

say() { echo "$*" | tee -a "$RESULTS"; }
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

HAVE_SMI=0
if [[ "$DEVICE" == cuda ]] && command -v nvidia-smi > /dev/null; then HAVE_SMI=1; fi
smi_start() {
  [[ $HAVE_SMI == 1 ]] || return 0
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$TMP/smi.log" 2> /dev/null &
  SMI_PID=$!
}
smi_stop() {
  [[ $HAVE_SMI == 1 ]] || return 0
  kill "$SMI_PID" 2> /dev/null || true
  wait "$SMI_PID" 2> /dev/null || true
  local peak
  peak=$(sort -n "$TMP/smi.log" 2> /dev/null | tail -1)
  say "nvidia-smi peak memory.used during this section: ${peak:-n/a} MiB (GPU total, all processes)"
}

NAMES=(); STATES=(); SECS=(); NOTES=()
FIRST_FAIL=""
record() {  # record NAME STATUS SECONDS NOTE
  NAMES+=("$1"); STATES+=("$2"); SECS+=("$3"); NOTES+=("$4")
  if [[ "$2" == FAIL && -z "$FIRST_FAIL" ]]; then FIRST_FAIL="$1: $4"; fi
  say "--- [$1] $2 in $3 s${4:+: $4}"
  say ""
}
section() {  # section NAME LIMIT_S CMD...: run CMD with a time limit, its output into the results file
  local name="$1" limit="$2"; shift 2
  say "=== [$name] $* (limit ${limit}s)"
  local t0 rc note=""
  t0=$(date +%s.%N)
  smi_start
  set +e
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$RESULTS"
  rc=${PIPESTATUS[0]}
  set -e
  smi_stop
  if [[ $rc == 0 ]]; then
    record "$name" PASS "$(elapsed "$t0")" ""
  else
    if [[ $rc == 124 || $rc == 137 ]]; then note="timed out after ${limit}s"; else note="exit status $rc"; fi
    record "$name" FAIL "$(elapsed "$t0")" "$note"
  fi
}

# --------------------------------------------------------------------------------------------- header
say "=== [header] gpu_check.sh --device $DEVICE$([[ $TINY == 1 ]] && echo ' --tiny (dry run: tiny shapes)')"
t0=$(date +%s.%N)
say "date: $(date -u +%Y-%m-%dT%H:%M:%SZ); host: $(hostname); commit: $(git rev-parse --short HEAD 2> /dev/null || echo n/a)$(git diff --quiet 2> /dev/null || echo ' (work tree modified)')"
set +e
"$PY" - "$DEVICE" << 'EOF' 2>&1 | tee -a "$RESULTS"
import platform, sys
import torch
print(f"python {platform.python_version()}; torch {torch.__version__}; torch CUDA {torch.version.cuda}; "
      f"cuda available {torch.cuda.is_available()}; CPU threads {torch.get_num_threads()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {torch.cuda.get_device_name(0)}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}, "
          f"bf16 supported {torch.cuda.is_bf16_supported()}, {torch.cuda.device_count()} device(s)")
try:
    import transformers
    print(f"transformers {transformers.__version__}")
except ImportError as e:
    print(f"transformers: {e}")
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    print("FAIL: --device cuda but torch sees no CUDA device (a CPU build of torch? README 'On a GPU': "
          "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128)")
    sys.exit(1)
EOF
rc=${PIPESTATUS[0]}
set -e
if [[ $HAVE_SMI == 1 ]]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 | tee -a "$RESULTS" || true
fi
if [[ $rc == 0 ]]; then record header PASS "$(elapsed "$t0")" ""; else record header FAIL "$(elapsed "$t0")" "torch/CUDA not usable"; fi

# ------------------------------------------------------------------------------------- bitsandbytes
OPTIM=adamw_torch
if [[ "$DEVICE" == cuda ]]; then
  say "=== [bnb] bitsandbytes for paged 8-bit AdamW"
  t0=$(date +%s.%N)
  set +e
  if ! "$PY" -c "import bitsandbytes" > /dev/null 2>&1; then
    if [[ -n "${BNB_WHEEL_DIR:-}" ]]; then
      timeout 45 "$PY" -m pip install --no-index --find-links "$BNB_WHEEL_DIR" bitsandbytes 2>&1 | tail -3 | tee -a "$RESULTS"
    else
      timeout 45 "$PY" -m pip install bitsandbytes 2>&1 | tail -3 | tee -a "$RESULTS"
    fi
  fi
  "$PY" -c "import bitsandbytes, bitsandbytes.optim as o; print('bitsandbytes', bitsandbytes.__version__, o.PagedAdamW8bit.__name__)" 2>&1 | tail -3 | tee -a "$RESULTS"
  rc=${PIPESTATUS[0]}
  set -e
  if [[ $rc == 0 ]]; then
    OPTIM=paged_adamw_8bit
    record bnb PASS "$(elapsed "$t0")" ""
  else
    record bnb FAIL "$(elapsed "$t0")" "bitsandbytes not importable (offline? set BNB_WHEEL_DIR); sections c and d fall back to adamw_torch"
  fi
else
  record bnb SKIP 0.0 "CPU dry run: adamw_torch (paged 8-bit AdamW needs CUDA)"
fi

# ------------------------------------------------------------------------------ a: batched vs oracle
# --repeats 1 (one memory run + one timed run per cell and implementation) keeps the 4 cells inside the limit.
if [[ $TINY == 1 ]]; then
  section a 140 "$PY" benchmarks/bench_codi_model.py --device "$DEVICE" --batch 2 --dtype fp32 --frames 2 --latent-steps 1 --repeats 1
else
  section a 140 "$PY" benchmarks/bench_codi_model.py --device cuda --batch 32 --dtype bf16 --repeats 1
fi

# ----------------------------------------------------------------------------------- b: decoding
# The self-trained tiny model trains on the CPU, then decodes on --device.
if [[ $TINY == 1 ]]; then
  section b 60 "$PY" benchmarks/bench_decoding.py --device "$DEVICE" --n 4 --steps 5 --max-new-tokens 64
else
  section b 60 "$PY" benchmarks/bench_decoding.py --device cuda --steps 100
fi

# ---------------------------------------------------------------------- c: 100 codi steps at 0.5B shape
if [[ $TINY == 1 ]]; then
  section c 130 "$PY" benchmarks/bench_memory.py --device cpu --dtype fp32 --optim "$OPTIM" --batch 2 --seq 300 \
    --layers 2 --vocab 2048 --steps 3 --configs teacher_ckpt --report-updates --no-projection
else
  section c 130 "$PY" benchmarks/bench_memory.py --device cuda --dtype bf16 --optim "$OPTIM" --batch 8 --seq 512 \
    --steps 100 --time-limit 100 --configs teacher_ckpt --report-updates --no-projection
fi

# ----------------------------------------------------------------------------- d: peak memory at 2048
if [[ $TINY == 1 ]]; then
  section d 90 "$PY" benchmarks/bench_memory.py --device cpu --dtype fp32 --optim "$OPTIM" --batch 2 --seq 300 \
    --layers 2 --vocab 2048 --steps 1 --configs teacher_ckpt,no_teacher_ckpt --no-projection
else
  section d 90 "$PY" benchmarks/bench_memory.py --device cuda --dtype bf16 --optim "$OPTIM" --batch 8 --seq 2048 \
    --steps 2 --configs teacher_ckpt,no_teacher_ckpt --no-projection
fi

# ---------------------------------------------------------------------------------------- summary
TOTAL=$(elapsed "$T_ALL")
say "=== summary (device $DEVICE$([[ $TINY == 1 ]] && echo ', tiny dry run'); total ${TOTAL} s; budget 480 s)"
say "| section | status | seconds | note |"
say "|---|---|---:|---|"
N_FAIL=0
for i in "${!NAMES[@]}"; do
  say "| ${NAMES[$i]} | ${STATES[$i]} | ${SECS[$i]} | ${NOTES[$i]} |"
  if [[ "${STATES[$i]}" == FAIL ]]; then N_FAIL=$((N_FAIL + 1)); fi
done
say "first failure: ${FIRST_FAIL:-none}"
if awk -v t="$TOTAL" 'BEGIN { exit !(t > 480) }'; then say "WARNING: took longer than the 8-minute budget"; fi
echo "gpu_check: results in $RESULTS"
[[ $N_FAIL == 0 ]]
