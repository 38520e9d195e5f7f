#!/usr/bin/env bash
# kvgen's GPU check, one command per stage (docs/gpu.md). Run from the repository root.
#
#   benchmarks/gpu_check.sh stage1    copies the first chunk of SmolLM2's GGUF to $WORK, runs the suite's
#                                     CUDA tests (Triton kernels and the engine on the GPU against torch)
#   benchmarks/gpu_check.sh stage2    joins the chunks, then: bandwidth, a random-weight Qwen2.5-Coder-1.5B
#                                     of the real file's shape, greedy tokens against transformers (SmolLM2
#                                     real weights, the 1.5B shape), batch-1 latency, throughput
#   benchmarks/gpu_check.sh all       both (where the whole GGUF is at .models/SmolLM2-135M-Instruct.Q4_1.gguf
#                                     or $SMOLLM2_GGUF)
#   benchmarks/gpu_check.sh profile   one short run (no GGUF, no suite) that explains the decode step: bandwidth,
#                                     the random 1.5B shape, where a batch-1 step's time goes (graph replay,
#                                     step wall time by phase, torch.profiler tables, host syncs), greedy
#                                     tokens judged by an fp32 reference, and a scaled throughput pair if time
#                                     is left. Keeps to KVGEN_CHECK_BUDGET_S (150 s) and leaves 4 files in
#                                     $OUT: summary.txt, results.json (every check's JSON), logs.txt, profile.txt
#
# The SmolLM2 file (98 MB) is carried in two chunks (.models/smollm2.gguf.part-aa and -ab, made by
# `split -b 50M`), one per stage. Wheels of missing pure-python packages go in .whl/ (installed with
# --no-index --no-deps into $WORK/site). Results: $OUT/<check>.json, <check>.log, summary.txt.
# Dry run on a CPU: KVGEN_CHECK_DEVICE=cpu KVGEN_CHECK_TINY=1 benchmarks/gpu_check.sh all
set -u
STAGE=${1:-all}
OUT=${OUT:-/tmp/kvgen-gpu-out}
WORK=${KVGEN_CHECK_WORK:-/tmp/kvgen-gpu}
DEVICE=${KVGEN_CHECK_DEVICE:-cuda}
TINY=${KVGEN_CHECK_TINY:-}
SMOLLM2_SHA256=${SMOLLM2_SHA256:-b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53}
mkdir -p "$OUT" "$WORK"
export KVGEN_CHECK_WORK=$WORK  # big files (models) go here, never under $OUT (which travels back)
START=$(date +%s)
SUMMARY=$OUT/summary.txt

export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  if [ ! -f "$WORK/site/.done" ]; then
    for w in .whl/*.whl; do  # one by one: a wheel for another Python (a dry run elsewhere) is skipped
      python -m pip install -q --no-index --no-deps --target "$WORK/site" "$w" >/dev/null 2>&1 \
        || echo "wheel $w not installable here (skipped)"
    done
    touch "$WORK/site/.done"
  fi
  export PYTHONPATH=$PYTHONPATH:$WORK/site
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false KVGEN_CACHE_DIR=$WORK/cache
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1  # no network there: fail fast, never wait

RES=$OUT  # where the checks write; the profile run writes to $WORK and gathers into a few files of $OUT
if [ "$STAGE" = profile ]; then
  RES=$WORK/results; rm -rf "$RES"; mkdir -p "$RES"; : > "$SUMMARY"
  BUDGET=${KVGEN_CHECK_BUDGET_S:-150}
fi
BUDGET=${BUDGET:-${KVGEN_CHECK_BUDGET_S:-0}}  # seconds for the whole run (0: none); a step gets what is left
ARGS=(--out "$RES" --device "$DEVICE")
[ -n "$TINY" ] && ARGS+=(--tiny)
FAILS=0

step() {  # step NAME SECONDS CMD...: runs CMD under timeout, logs it, records PASS/FAIL
  local name=$1 limit=$(( $2 * ${KVGEN_CHECK_TIME_SCALE:-1} )); shift 2
  local t0=$(date +%s)
  if [ "$BUDGET" -gt 0 ]; then
    local left=$(( BUDGET - (t0 - START) ))
    if [ "$left" -lt 15 ]; then
      echo "SKIP $name: ${left} s of the ${BUDGET} s budget left"; echo "SKIP $name (budget)" >> "$SUMMARY"; return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  timeout -k 5 "$limit" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  grep -E '^FAIL ' "$RES/$name.log" || true
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "FAIL $name: timed out after ${limit} s (log: $name.log)"; echo "FAIL $name timeout" >> "$SUMMARY"; FAILS=$((FAILS+1))
  elif [ $rc -ne 0 ]; then
    echo "FAIL $name: exit $rc; last lines:"; tail -n 8 "$RES/$name.log" | sed 's/^/    /'
    echo "FAIL $name exit $rc" >> "$SUMMARY"; FAILS=$((FAILS+1))
  else
    local line="PASS $name ($(( $(date +%s) - t0 )) s): $(grep -v '^\s*$' "$RES/$name.log" | tail -n 1 | cut -c1-300)"
    echo "$line"; echo "$line" >> "$SUMMARY"
  fi
  if [ "$STAGE" = profile ]; then gather; fi
}

gather() {  # the profile run: every check's JSON, log and profile tables into few files of $OUT, after each step
  python - "$RES" "$OUT" <<'EOF' || true
import json, sys
from pathlib import Path
res, out = Path(sys.argv[1]), Path(sys.argv[2])
merged = {}
for f in sorted(res.glob("*.json")):
    try:
        merged[f.stem] = json.loads(f.read_text())
    except Exception as e:
        merged[f.stem] = {"unreadable": repr(e), "text": f.read_text()[:2000]}
(out / "results.json").write_text(json.dumps(merged, indent=1))
(out / "logs.txt").write_text("".join(f"===== {f.name}\n{f.read_text(errors='replace')[-20000:]}\n"
                                      for f in sorted(res.glob("*.log"), key=lambda f: f.stat().st_mtime)))
if (res / "profile.txt").exists():
    (out / "profile.txt").write_text((res / "profile.txt").read_text())
EOF
}

PY=(python benchmarks/gpu_check.py)

env_report() {
  python - <<'EOF' > "$RES/environment.json" 2>&1
import json, sys, torch
info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
for name in ("triton", "transformers", "gguf", "yaml", "pytest", "sentencepiece", "safetensors", "tokenizers"):
    try:
        info[name] = getattr(__import__(name), "__version__", "present")
    except Exception as e:
        info[name] = f"missing ({type(e).__name__})"
print(json.dumps(info, indent=1))
EOF
  cat "$RES/environment.json"
}

stage1() {
  echo "== stage1 $(date -u +%T)"
  env_report
  if [ -f .models/smollm2.gguf.part-aa ]; then cp .models/smollm2.gguf.part-aa "$WORK/"; echo "chunk a copied to $WORK"; fi
  local test_env=(env KVGEN_TEST_CUDA=1)
  [ "$DEVICE" = cpu ] && test_env=(env)
  step cuda-tests 300 "${test_env[@]}" python -m pytest -q -p no:cacheprovider tests/gpu \
       --junitxml "$RES/cuda-tests.xml"
}

smollm2_path() {
  if [ -n "${SMOLLM2_GGUF:-}" ]; then echo "$SMOLLM2_GGUF"; return; fi
  if [ -f .models/SmolLM2-135M-Instruct.Q4_1.gguf ]; then echo "$PWD/.models/SmolLM2-135M-Instruct.Q4_1.gguf"; return; fi
  local joined=$WORK/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -f "$joined" ] && [ -f "$WORK/smollm2.gguf.part-aa" ] && [ -f .models/smollm2.gguf.part-ab ]; then
    cat "$WORK/smollm2.gguf.part-aa" .models/smollm2.gguf.part-ab > "$joined.tmp" && mv "$joined.tmp" "$joined"
  fi
  [ -f "$joined" ] && echo "$joined"
}

stage2() {
  echo "== stage2 $(date -u +%T)"
  [ -f "$RES/environment.json" ] || env_report
  local smol
  smol=$(smollm2_path)
  if [ -z "$smol" ]; then
    echo "FAIL smollm2: no model (chunk a missing from $WORK: stage1 ran on another machine? rerun stage1)"
    echo "FAIL smollm2 missing" >> "$SUMMARY"; FAILS=$((FAILS+1))
  elif [ -n "$SMOLLM2_SHA256" ] && ! echo "$SMOLLM2_SHA256  $smol" | sha256sum -c --quiet -; then
    echo "FAIL smollm2: checksum mismatch"; FAILS=$((FAILS+1)); smol=""
  fi
  local config=benchmarks/configs/qwen2.5-coder-1.5b.json big=$WORK/qwen2.5-coder-1.5b-random
  if [ -n "$TINY" ]; then config=benchmarks/configs/tiny-qwen2.json; big=$WORK/tiny-qwen2-random; fi
  step bandwidth 30 "${PY[@]}" bandwidth "${ARGS[@]}"
  step build-model 60 "${PY[@]}" build-model --config "$config" --model-dir "$big" "${ARGS[@]}"
  [ -n "$smol" ] && step tokens-smollm2 60 "${PY[@]}" tokens --model "$smol" --label smollm2 "${ARGS[@]}"
  step tokens-qwen1.5b-random 60 "${PY[@]}" tokens --model "$big" --label qwen1.5b-random --random-ids "${ARGS[@]}"
  step latency-kvgen 45 "${PY[@]}" latency-kvgen --model "$big" "${ARGS[@]}"
  step latency-hf 120 "${PY[@]}" latency-hf --model "$big" "${ARGS[@]}"
  step throughput-kvgen 75 "${PY[@]}" throughput-kvgen --model "$big" "${ARGS[@]}"
  # transformers' manager took over 80 s for the 256 requests (the first H200 run): it gets the first 64,
  # and kvgen runs the same 64 beside it for the ratio (throughput-*-64, said so in their JSON)
  step throughput-kvgen-64 60 "${PY[@]}" throughput-kvgen --requests 64 --model "$big" "${ARGS[@]}"
  step throughput-hf-64 120 "${PY[@]}" throughput-hf --requests 64 --peer-timeout 90 --model "$big" "${ARGS[@]}"
}

profile() {
  echo "== profile $(date -u +%T), budget ${BUDGET} s"
  env_report; gather
  local config=benchmarks/configs/qwen2.5-coder-1.5b.json big=$WORK/qwen2.5-coder-1.5b-random
  if [ -n "$TINY" ]; then config=benchmarks/configs/tiny-qwen2.json; big=$WORK/tiny-qwen2-random; fi
  step bandwidth 30 "${PY[@]}" bandwidth "${ARGS[@]}"
  step build-model 60 "${PY[@]}" build-model --config "$config" --model-dir "$big" "${ARGS[@]}"
  step profile 75 "${PY[@]}" profile --model "$big" "${ARGS[@]}"
  step tokens-qwen1.5b-random 60 "${PY[@]}" tokens --model "$big" --label qwen1.5b-random --random-ids "${ARGS[@]}"
  step throughput-kvgen-32 30 "${PY[@]}" throughput-kvgen --requests 32 --model "$big" "${ARGS[@]}"
  step throughput-hf-32 45 "${PY[@]}" throughput-hf --requests 32 --peer-timeout 25 --model "$big" "${ARGS[@]}"
}

case "$STAGE" in
  stage1) stage1 ;;
  stage2) stage2 ;;
  all) stage1; stage2 ;;
  profile) profile ;;
  *) echo "usage: $0 stage1|stage2|all|profile"; exit 2 ;;
esac
echo "== done in $(( $(date +%s) - START )) s, $FAILS failed; results in $OUT"
cat "$SUMMARY"
[ "$STAGE" = profile ] || cp "$SUMMARY" "$OUT/summary-$STAGE.txt" 2>/dev/null
exit $FAILS
