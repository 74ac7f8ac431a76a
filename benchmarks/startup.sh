#!/usr/bin/env bash
# Start-up times users feel, best of N (default 5) with plain `time`-style wall clocks:
#   strata-bench --help, argument and setting errors (answered before torch is imported), the
#   engine's import (torch without torch._dynamo), a load of the demo model, the app's splash,
#   and the app's main window.
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
times, codes = [], set()
for _ in range(n):
    t = time.perf_counter()
    codes.add(subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode)
    times.append(time.perf_counter() - t)
print(f"{min(times):.2f} s best, {max(times):.2f} s worst of {n} (exit {'/'.join(map(str, sorted(codes)))})")
PYEOF
}
echo "| what | command | wall |"
echo "|---|---|---|"
echo "| CLI help | strata-bench --help | $(best help "$PY" -m engine.cli.bench --help) |"
echo "| CLI argument error | strata-bench run --prompt-tokens abc | $(best err "$PY" -m engine.cli.bench run --prompt-tokens abc) |"
echo "| CLI setting error | strata-bench run --chunk-tokens 0 | $(best err "$PY" -m engine.cli.bench run --chunk-tokens 0) |"
echo "| CLI device error | strata-bench run --devices cuda:9999 | $(best err "$PY" -m engine.cli.bench run --devices cuda:9999) |"
echo "| CLI unknown arm setting | strata-bench run --arm chunk_size=128 | $(best err "$PY" -m engine.cli.bench run --arm chunk_size=128) |"
echo "| engine import | python -c 'import engine.pipeline.session' | $(best imp "$PY" -c 'import engine.pipeline.session') |"
echo "| CLI load, demo model | strata-bench load --model demo --devices cpu | $(best load "$PY" -m engine.cli.bench load --model demo --devices cpu) |"
echo "| app splash on screen | strata-gui --startup-exit splash | $(best splash "$PY" -m strata_gui --startup-exit splash) |"
echo "| app main window shown | strata-gui --startup-exit window | $(best window "$PY" -m strata_gui --startup-exit window) |"
