#!/usr/bin/env bash
# Start-up times users feel, best of N (default 5) with plain `time`-style wall clocks:
#   strata-bench --help, argument and setting errors (answered before torch is imported), the
#   engine's import (torch without torch._dynamo), a load of the demo model, the app's splash,
#   and the app's main window (the time until it is shown); then what is imported before it shows.
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
shown() {  # best seconds until the app writes "strata-gui: WHAT on screen" (not counting its exit)
  "$PY" - "$N" "$@" <<'PYEOF'
import subprocess, sys, time
n, what, cmd = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
shown, ended = [], []
for _ in range(n):
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        if line.strip() == f"strata-gui: {what} on screen":
            shown.append(time.perf_counter() - t)
    p.wait()
    ended.append(time.perf_counter() - t)
if not shown:
    print("never shown")
else:
    print(f"{min(shown):.2f} s best, {max(shown):.2f} s worst of {n} (process exit {min(ended):.2f} s best)")
PYEOF
}
echo "| app splash on screen | strata-gui --startup-exit splash | $(shown splash "$PY" -m strata_gui --startup-exit splash) |"
echo "| app main window on screen | strata-gui --startup-exit window | $(shown window "$PY" -m strata_gui --startup-exit window) |"
# What is imported before the main window is on screen: self time per top-level package (one run of
# `python -X importtime -m strata_gui --startup-exit window`, up to its "window on screen" line;
# engine.* by package; what the held background jobs import after it is left out)
echo
echo "imports before the main window (one run, python -X importtime): $("$PY" - "$PY" <<'PYEOF'
import collections, subprocess, sys
err = subprocess.run([sys.argv[1], "-X", "importtime", "-m", "strata_gui", "--startup-exit", "window"],
                     capture_output=True, text=True).stderr
tot = collections.Counter()
for line in err.splitlines():
    if line.strip() == "strata-gui: window on screen":
        break
    parts = line.split("|")
    if not line.startswith("import time:") or len(parts) != 3 or not parts[0].split(":")[1].strip().isdigit():
        continue
    name = parts[2].strip()
    top = ".".join(name.split(".")[:2]) if name.startswith("engine.") else name.split(".")[0]
    tot[top] += int(parts[0].split(":")[1])
total = sum(tot.values())
print(f"{total / 1e6:.2f} s in all; " + ", ".join(f"{k} {v / 1e6:.2f} s" for k, v in tot.most_common(8)))
PYEOF
)"
