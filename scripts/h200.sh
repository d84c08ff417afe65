#!/usr/bin/env bash
# Build, test, sanitize and benchmark ddtree_ext's CUDA kernels on a GPU machine (made for the H200:
# torch with CUDA 13, nvcc, compute-sanitizer; no package registry needed).
#
#   OUT=/some/dir [FLA_PATH=/dir/with/fla] [E2E_ARGS="--preset 4b"] [TORCH_CUDA_ARCH_LIST=9.0a] scripts/h200.sh [build] [test] [gputest] [gdn] [linear] [walk] [sanitize] [bench] [e2e] [ab]
#   FLA_PATH: a folder with flash-linear-attention installed, for the `test` stage's chain comparisons; the machine has
#   no registry, so download its pure-Python wheels here (pip download --no-deps -d .whl flash-linear-attention
#   fla-core einops), carry .whl, and there: pip install --no-index --no-deps --target DIR .whl/*.whl.
#   (default: build test sanitize bench e2e, in order; gputest = only the GPU test files, for quick runs (PYTEST_K: a
#   -k expression to run fewer; BENCH_K, the same for bench); ab = e2e.py with E2E_ARGS and with E2E_ARGS plus AB_ARGS, side by side in ab.md
#   (AB_ORDER="a b b a" repeats the sides);
#   gdn = the GDN and commit CUDA tests, then the tree GDN op's per-layer timing at 27B shapes, for A/B runs;
#   linear = the projection kernel's CUDA tests, memcheck over them, and its benchmarks against F.linear;
#   walk = the walk, sampling and top-K CUDA tests, memcheck and racecheck over a few, and their benchmarks)
#
# Set DDTREE_COMMIT to the tree's commit: a copy of the tree may carry a stale .git, and the reports name the commit.
# The build targets 9.0a (Hopper's own instructions: the projection kernel's wgmma); 9.0 builds its mma.sync path.
# Stages can run in separate calls (the in-place build stays in the worktree). Every log goes to $OUT:
# build.log (with ptxas register/spill lines), tests.log, gdn.log, linear.log, memcheck.log, racecheck.log, bench.log,
# bench.json and bench.md, e2e.log and results/ (benchmarks/e2e.py's JSON and Markdown). The exit status is
# nonzero when any stage failed; later stages still run.
set -uo pipefail

OUT=${OUT:?set OUT to the output folder}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(build test sanitize bench e2e)
status=0

run() {  # run LOG CMD...: tee the command's output into $OUT/LOG, remember a failure
  local log=$1
  shift
  echo "== $* (log: $OUT/$log)"
  "$@" 2>&1 | tee -a "$OUT/$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -ne 0 ] && { echo "!! failed with status $rc: $*" | tee -a "$OUT/$log"; status=1; }
  return 0
}

# The subset compute-sanitizer runs: every op once on small inputs, plus the argument checks.
SANITIZE_TESTS=(tests/test_cuda.py -q -x -k "all_ops_small or mixed_devices")

for stage in "${STAGES[@]}"; do
  case $stage in
    build)
      : > "$OUT/build.log"
      # Compile and link with the system compiler: the image's Python was built with a toolchain whose g++
      # links libstdc++ statically into extensions, and a second libstdc++ in the process crashes the
      # first time an error message formats a number (seen on the H200 image, 2026-11-29).
      run build.log env CC=gcc CXX=g++ LDSHARED="g++ -shared" DDTREE_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" MAX_JOBS=16 NVCC_APPEND_FLAGS="-Xptxas -v" \
        "$PY" setup.py build_ext --inplace
      run build.log "$PY" -c "import torch, ddtree_ext; print('build_info', ddtree_ext.build_info()); \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name())"
      run build.log nvidia-smi
      ;;
    test)
      : > "$OUT/tests.log"
      run tests.log "$PY" -m pytest tests -q -rs --durations=15
      # fla only for the chain comparisons: with fla importable, transformers' Qwen3.5 calls fla's Triton
      # kernels even on CPU tensors, which breaks the CPU tests. FLA_PATH: where the carried wheels are installed.
      if [ -n "${FLA_PATH:-}" ]; then
        run tests.log env PYTHONPATH="$PYTHONPATH:$FLA_PATH" "$PY" -m pytest tests/test_cuda.py -q -rs -k fla
      fi
      ;;
    gputest)
      : > "$OUT/gputests.log"
      run gputests.log "$PY" -m pytest tests/test_cuda.py tests/test_generate_cuda.py tests/test_multi_gpu.py -q -rs \
        -n "${PYTEST_WORKERS:-8}" --durations=10 ${PYTEST_K:+-k "$PYTEST_K"}
      ;;
    sanitize)
      : > "$OUT/memcheck.log"
      : > "$OUT/racecheck.log"
      run memcheck.log compute-sanitizer --tool memcheck --error-exitcode 99 "$PY" -m pytest "${SANITIZE_TESTS[@]}"
      run racecheck.log compute-sanitizer --tool racecheck --error-exitcode 99 "$PY" -m pytest "${SANITIZE_TESTS[@]}"
      ;;
    bench)
      : > "$OUT/bench.log"
      run bench.log "$PY" -m pytest benchmarks --benchmark-only --benchmark-json "$OUT/bench.json" -q ${BENCH_K:+-k "$BENCH_K"}
      run bench.log "$PY" scripts/summarize_bench.py "$OUT/bench.json" --out "$OUT/bench.md"
      [ -f "$OUT/bench.md" ] && cat "$OUT/bench.md"
      ;;
    gdn)
      : > "$OUT/gdn.log"
      run gdn.log "$PY" -m pytest tests/test_cuda.py -q -n "${PYTEST_WORKERS:-8}" -k "gated_delta or gdn or commit or all_ops"
      run gdn.log "$PY" scripts/profile_gdn.py --nodes 1 17 65 129 257 --time
      ;;
    walk)
      : > "$OUT/walk.log"
      run walk.log "$PY" -m pytest tests/test_cuda.py tests/test_generate_cuda.py -q -rs -n "${PYTEST_WORKERS:-8}" \
        -k "walk or sample or topk or all_ops or graph_replay"
      run walk.log compute-sanitizer --tool memcheck --error-exitcode 99 "$PY" -m pytest tests/test_cuda.py -q -x \
        -k "(test_walk_sample and dtype2 and not ties and not full) or garbage"
      run walk.log compute-sanitizer --tool racecheck --error-exitcode 99 "$PY" -m pytest tests/test_cuda.py -q -x \
        -k "test_walk_sample and dtype2 and not ties and (0.9-0-0.9 or 20 or 1.0-100-0.95 or 0.8-300 or radix)"
      run walk.log "$PY" -m pytest benchmarks/test_bench_cuda.py -q -k "walk_sample or topk" --benchmark-only \
        --benchmark-json "$OUT/bench_walk.json"
      run walk.log "$PY" scripts/summarize_bench.py "$OUT/bench_walk.json" --out "$OUT/bench_walk.md"
      [ -f "$OUT/bench_walk.md" ] && cat "$OUT/bench_walk.md"
      ;;
    linear)
      : > "$OUT/linear.log"
      run linear.log "$PY" -m pytest tests/test_cuda.py -q -rs -n "${PYTEST_WORKERS:-8}" \
        -k "linear or all_ops_small or graph_replay or deterministic or kv_prefetch"
      run linear.log compute-sanitizer --tool memcheck --error-exitcode 99 "$PY" -m pytest tests/test_cuda.py -q -x \
        -k "linear_rows_do_not_depend or linear_prefetch"  # no profiler under the sanitizer
      run linear.log "$PY" -m pytest benchmarks/test_bench_cuda.py -q -k test_linear --benchmark-only \
        --benchmark-json "$OUT/bench_linear.json"
      run linear.log "$PY" scripts/summarize_bench.py "$OUT/bench_linear.json" --out "$OUT/bench_linear.md"
      [ -f "$OUT/bench_linear.md" ] && cat "$OUT/bench_linear.md"
      ;;
    e2e)
      : > "$OUT/e2e.log"
      # shellcheck disable=SC2086
      run e2e.log "$PY" benchmarks/e2e.py --out "$OUT/results" ${E2E_ARGS:-}
      ;;
    ab)
      # An A/B of whole rounds in one call: e2e.py with E2E_ARGS (A) and with E2E_ARGS plus AB_ARGS (B), the sides in
      # AB_ORDER (default "a b"; "a b b a" spreads the machine's drift over both), then scripts/compare_e2e.py.
      : > "$OUT/ab.log"
      if [ -z "${AB_ARGS:-}" ]; then
        echo "!! ab: set AB_ARGS to the B side's extra e2e.py arguments" | tee -a "$OUT/ab.log"
        status=1
        continue
      fi
      reports=()
      labels=()
      n=0
      for side in ${AB_ORDER:-a b}; do
        n=$((n + 1))
        extra=""
        [ "$side" = b ] && extra=$AB_ARGS
        # shellcheck disable=SC2086
        run ab.log "$PY" benchmarks/e2e.py --out "$OUT/results_$side$n" ${E2E_ARGS:-} $extra
        for f in "$OUT/results_$side$n"/*.json; do [ -f "$f" ] && reports+=("$f") && labels+=("$side$n"); done
      done
      labels_csv=$(IFS=,; echo "${labels[*]}")
      run ab.log "$PY" scripts/compare_e2e.py "${reports[@]}" --labels "$labels_csv" --out "$OUT/ab.md"
      ;;
    *)
      echo "unknown stage: $stage (build, test, gputest, gdn, linear, walk, sanitize, bench, e2e, ab)"
      status=1
      ;;
  esac
done
exit $status
