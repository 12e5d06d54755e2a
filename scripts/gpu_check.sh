#!/usr/bin/env bash
# The GPU acceptance run, one command (<= 8 minutes on one H200): writes OUTDIR/gpu_check.json and
# OUTDIR/gpu_check.log (default OUTDIR: gpu_check_out/ at the repo root).
#   usage: scripts/gpu_check.sh [OUTDIR]        (PYTHON=... picks the Python; default python3)
# Through the device tool, after scripts/gpu_wheels.sh here:
#   run(command="scripts/gpu_check.sh $OUT", carry=[".whl"], timeout_s=540)
# Steps (each under its own timeout, all inside GPU_CHECK_BUDGET_S, default 460 s):
#   install  the carried .whl/*.whl and this checkout (no deps, no index) into /tmp/site (GPU_CHECK_SITE)
#   tests    the `gpu`-marked tests (Triton kernel parity, the fused kernels under shard_map, cuDNN attention
#            parity), one line per failure, each test capped at 60 s (pytest-timeout is in the image)
#   logprobs rljax.kernels.bench_logprobs, Qwen2.5-7B's head: N=8192 d=3584 V=152064 bf16, fwd+bwd, entropy,
#            xla / triton against reference in the same run (time, compiled temp memory, error)
#   train    benchmarks/bench_train_step.py on the Qwen2.5-1.5B shape, bf16, 8 x 1024 tokens (tokens/s, MFU;
#            1.54B parameters: f32 masters and Adam ~25 GB, activations without remat ~24 GB)
#   attention benchmarks/bench_attention.py: cudnn vs blockwise at 2 x 4096 tokens, 28/4 heads of 128, bf16
#   plan     benchmarks/check_memory_share.py: JAX's pool on GPU 0 is the share the device plan gives the
#            trainer beside a colocated server (XLA_PYTHON_CLIENT_MEM_FRACTION; rljax.device_plan)
# Without an NVIDIA GPU it prints "no NVIDIA GPU: skipped", writes {"status": "skipped", ...} and exits 0.
# Exit status: 0 when every step passed (or skipped), 1 otherwise; the JSON says which step failed.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUTDIR=${1:-$REPO/gpu_check_out}
mkdir -p "$OUTDIR/parts"
OUTDIR=$(cd "$OUTDIR" && pwd)
LOG=$OUTDIR/gpu_check.log
JSON=$OUTDIR/gpu_check.json
PARTS=$OUTDIR/parts
PY=${PYTHON:-python3}
: >"$LOG"
: >"$PARTS/steps.tsv"
log() { echo "$*" | tee -a "$LOG"; }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    log "no NVIDIA GPU: skipped (nvidia-smi finds no GPU on $(hostname))"
    printf '{"status": "skipped", "reason": "no NVIDIA GPU", "host": "%s", "steps": {}}\n' "$(hostname)" >"$JSON"
    exit 0
fi

DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-460}))
# step NAME CAP_S CMD...: runs CMD (cwd OUTDIR, so the checkout's rljax/ does not shadow /tmp/site) under
# min(CAP_S, time left), output into the log, and records "NAME rc seconds" in steps.tsv.
step() {
    local name=$1 cap=$2 left=$((DEADLINE - SECONDS))
    shift 2
    ((left < cap)) && cap=$left
    if ((cap < 10)); then
        log "== $name: not run (out of time)"
        printf '%s\t%s\t%s\n' "$name" "not-run" 0 >>"$PARTS/steps.tsv"
        return
    fi
    log "== $name (timeout ${cap}s): $*"
    local t0=$SECONDS
    (cd "$OUTDIR" && timeout "$cap" "$@") 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    log "== $name: rc=$rc in $((SECONDS - t0))s"
    printf '%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - t0)) >>"$PARTS/steps.tsv"
}

nvidia-smi -L | tee -a "$LOG"
export JAX_PLATFORMS=cuda  # tests/conftest.py defaults to cpu otherwise
SITE=${GPU_CHECK_SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 PYTHONPATH=$SITE REPO PY PARTS SITE
install() {
    shopt -s nullglob
    local wheels=("$REPO"/.whl/*.whl)
    if ((${#wheels[@]})); then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "${wheels[@]}" || return 1
    else
        echo "no carried wheels in $REPO/.whl (run scripts/gpu_wheels.sh first): jax-triton will be missing"
    fi
    # rljax itself (rljax.kernels lives in kernels/, so the checkout alone is not importable as a package).
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$SITE" \
        "$REPO" || return 1
    "$PY" - <<'EOF' | tee "$PARTS/versions.json"
import importlib, importlib.metadata as md, json
import jax
out = {"devices": [d.device_kind for d in jax.devices()], "backend": jax.default_backend(), "versions": {}}
for name in ["jax", "jaxlib", "jax-cuda13-plugin", "triton", "jax-triton", "torch", "flax", "optax", "chex",
             "ml-collections", "orbax-checkpoint", "transformers"]:
    try:
        out["versions"][name] = md.version(name)
    except md.PackageNotFoundError:
        out["versions"][name] = None
for mod in ["rljax.kernels", "rljax.trainer", "jax_triton", "flax.linen", "flax.nnx"]:
    try:
        importlib.import_module(mod)
        out[f"imports {mod}"] = "ok"
    except Exception as e:  # recorded, not fatal: flax is not on the GPU path
        out[f"imports {mod}"] = f"{type(e).__name__}: {e}"[:300]
print(json.dumps(out))
EOF
}
export -f install
step install 60 bash -c install
step plan 40 "$PY" "$REPO/benchmarks/check_memory_share.py" --gpus 1 --json "$PARTS/plan.json" -- \
    --config="$REPO/configs/grpo.py"
# one line per failure (--tb=line) and a per-test cap, so a slow compile or a hang cannot hide the rest
step tests 170 "$PY" -m pytest -q -p no:cacheprovider -m gpu --tb=line -rfE --timeout 60 --junitxml="$PARTS/tests.xml" \
    "$REPO/tests/kernels/test_kernels.py" "$REPO/tests/kernels/test_kernels_sharded.py" "$REPO/tests/models/test_attention.py"
step logprobs 90 "$PY" -m rljax.kernels.bench_logprobs --n 8192 --d 3584 --v 152064 --dtype bfloat16 \
    --entropy --impls xla,triton --repeats 3 --json "$PARTS/logprobs.json"
step train 110 "$PY" "$REPO/benchmarks/bench_train_step.py" --model qwen2.5-1.5b --rows 8 --length 1024 \
    --compute-dtype bfloat16 --remat none --iters 3 --json "$PARTS/train_step.json"
step attention 50 "$PY" "$REPO/benchmarks/bench_attention.py" --impls cudnn,blockwise --batch 2 --length 4096 \
    --heads 28 --kv-heads 4 --head-dim 128 --dtype bfloat16 --iters 5 --json "$PARTS/attention.json"

"$PY" - "$PARTS" "$JSON" <<'EOF' | tee -a "$LOG"
import json, pathlib, sys, xml.etree.ElementTree as ET
parts, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def read(name):
    try:
        return json.loads((parts / name).read_text())
    except (OSError, ValueError):  # the step failed before writing it
        return None
steps = {}
for line in (parts / "steps.tsv").read_text().splitlines():
    name, rc, secs = line.split("\t")
    steps[name] = {"rc": None if rc == "not-run" else int(rc), "seconds": int(secs), "timed_out": rc == "124"}
report = {"status": "ok" if all(s["rc"] == 0 for s in steps.values()) else "failed", "steps": steps}
if (parts / "tests.xml").exists():
    suite = next(ET.parse(parts / "tests.xml").getroot().iter("testsuite"))
    report["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
report.update(versions=read("versions.json"), logprobs=read("logprobs.json"),
              train_step=read("train_step.json"), attention=read("attention.json"), plan=read("plan.json"))
impls = (report["logprobs"] or {}).get("impls", {})
accept = {}
for name in ("triton",):  # pallas is refused on GPUs (rljax.kernels.RUNS_ON)
    r = impls.get(name, {})
    accept[name] = {"ran": "seconds" in r, "speedup_vs_xla >= 1.3": r.get("speedup_vs_xla", 0) >= 1.3,
                    "mem_ratio_vs_reference >= 10": r.get("mem_ratio_vs_reference", 0) >= 10}
mfu = (report["train_step"] or {}).get("mfu")
accept["train_step_mfu"] = mfu
accept["train_step_mfu >= 0.35"] = mfu is not None and mfu >= 0.35
accept["planned memory share honoured"] = bool((report["plan"] or {}).get("honoured"))
report["acceptance"] = accept
out.write_text(json.dumps(report, indent=1))
print(json.dumps({"status": report["status"], "acceptance": accept}, indent=1))
EOF
grep -q '"status": "ok"' "$JSON"
