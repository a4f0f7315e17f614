#!/usr/bin/env bash
# Runs the test suite as other CPUs would compute it, one configuration at a
# time, and prints each one's pass/fail counts.
#
# XLA:CPU picks its kernels, summation orders and vector widths by CPU
# features and thread count, so a float32 result moves in its last bits from
# one machine to the next. Each run below changes that on this machine:
#
#   avx2       XLA's code generation limited to AVX2 (--xla_cpu_max_isa=AVX2)
#   sse4_2     ... and to SSE4.2: other vectorised elementwise math
#   no_ynn     reductions and products by XLA's own emitters instead of
#              YNNPACK's kernels (--xla_cpu_experimental_ynn_fusion_type=):
#              other summation orders, as on a CPU where other kernels win
#   one_core   the whole run pinned to one core (taskset -c 0)
#
# Usage: bash tests/other_cpus.sh [CONFIG ...] [-- PYTEST_ARGS ...]
#   (default: all four configurations, the README's pytest command; the
#   pytest arguments replace "-n 2 -q"). Exits non-zero if any run failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

configs=()
while [[ $# -gt 0 && "$1" != "--" ]]; do configs+=("$1"); shift; done
[[ "${1:-}" == "--" ]] && shift
pytest_args=("$@")
[[ ${#pytest_args[@]} -eq 0 ]] && pytest_args=(-n 2 -q)
[[ ${#configs[@]} -eq 0 ]] && configs=(avx2 sse4_2 no_ynn one_core)

# Every configuration compiles afresh: the suite's persistent compilation
# cache (tests/conftest.py) would hand one run the programs compiled for
# another (the thread count, for one, is not in its key).
export JAX_ENABLE_COMPILATION_CACHE=false

status=0
summary=()
for config in "${configs[@]}"; do
  prefix=()
  flags="${XLA_FLAGS:-}"
  case "$config" in
    avx2) flags+=" --xla_cpu_max_isa=AVX2" ;;
    sse4_2) flags+=" --xla_cpu_max_isa=SSE4_2" ;;
    no_ynn) flags+=" --xla_cpu_experimental_ynn_fusion_type=" ;;
    one_core) prefix=(taskset -c 0) ;;
    *) echo "unknown configuration: $config (avx2, sse4_2, no_ynn, one_core)" >&2
       exit 2 ;;
  esac
  echo "== $config: XLA_FLAGS='${flags# }' ${prefix[*]} python -m pytest ${pytest_args[*]}"
  start=$SECONDS
  log=$(mktemp)
  XLA_FLAGS="${flags# }" "${prefix[@]}" python -m pytest -p no:cacheprovider \
      "${pytest_args[@]}" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  [[ $rc -ne 0 ]] && status=1
  summary+=("$config: $(grep -E '(passed|failed|error)' "$log" | tail -n 1) (exit $rc, $((SECONDS - start)) s)")
  rm -f "$log"
done
echo
printf '%s\n' "${summary[@]}"
exit $status
