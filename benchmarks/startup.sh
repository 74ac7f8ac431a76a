#!/usr/bin/env bash
# Start-up times users feel, best of N (default 5) with plain `time`-style wall clocks:
#   strata-bench --help, an argument error, the app's splash, and the app's main window.
# Usage: bash benchmarks/startup.sh [N]   (QT_QPA_PLATFORM defaults to offscreen)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
N=${1:-5}
export QT_QPA_PLATFORM=${QT_QPA_PLATFORM:-offscreen}
best() {  # best wall seconds of N runs of a command
  local name=$1; shift
  "$PY" - "$N" "$@" <<'PYEOF'
import subprocess, sys, time
n, cmd = int(sys.argv[1]), sys.argv[2:]
times = []
for _ in range(n):
    t = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    times.append(time.perf_counter() - t)
print(f"{min(times):.2f} s best, {max(times):.2f} s worst of {n}")
PYEOF
}
echo "| what | command | wall |"
echo "|---|---|---|"
echo "| CLI help | strata-bench --help | $(best help "$PY" -m engine.bench --help) |"
echo "| CLI argument error | strata-bench run --prompt-tokens abc | $(best err "$PY" -m engine.bench run --prompt-tokens abc) |"
echo "| app splash on screen | strata-gui --startup-exit splash | $(best splash "$PY" -m strata_gui --startup-exit splash) |"
echo "| app main window shown | strata-gui --startup-exit window | $(best window "$PY" -m strata_gui --startup-exit window) |"
