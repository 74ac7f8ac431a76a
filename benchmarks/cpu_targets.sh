#!/usr/bin/env bash
# Issue 33's CPU targets on the file llama.cpp's quantizer makes (qwen3moe, 8 layers, hidden 1024,
# 16 experts of 512, top-4, Q4_K_M; `bash scripts/llamacpp_quant_files.sh cpu-bench DIR`):
#   a 16-token prompt within 3 s of a bare `import torch` (load included), pp512 >= 50 tok/s.
#   bash benchmarks/cpu_targets.sh FILE [REPEATS]
# Wall times are the best of REPEATS (default 3) whole processes, so a busy machine's worst
# moments do not decide the figure; the load average is printed with them.
set -euo pipefail
cd "$(dirname "$0")/.."
F=${1:?"the Q4_K_M file (make it: bash scripts/llamacpp_quant_files.sh cpu-bench DIR)"}
N=${2:-3}
PY=${PYTHON:-.venv/bin/python}
best() {  # best wall seconds of N runs of "$@" (output discarded)
  "$PY" - "$N" "$@" <<'PY'
import subprocess, sys, time
n, cmd = int(sys.argv[1]), sys.argv[2:]
walls = []
for _ in range(n):
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    walls.append(time.perf_counter() - t)
print(f"{min(walls):.2f}")
PY
}
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg); file $F ($(stat -c %s "$F") bytes)"
t_import=$(best "$PY" -c "import torch")
t_run=$(best "$PY" -m engine.cli.bench run -m "$F" --devices cpu -p 16 -n 0 -r 1 --quiet)
pp=$("$PY" -m engine.cli.bench run -m "$F" --devices cpu -p 512 -n 0 -r "$N" -o csv --quiet 2>/dev/null \
     | "$PY" -c "import csv,sys; r=[x for x in csv.DictReader(sys.stdin) if x.get('test')=='pp512']; print(r[0]['prefill tok/s'] if r else '?')")
echo
echo "| what | figure | target | met |"
echo "|---|---:|---:|---|"
"$PY" - "$t_import" "$t_run" "$pp" <<'PY'
import sys
imp, run, pp = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
print(f"| python -c 'import torch' (best of runs) | {imp:.2f} s | — | — |")
print(f"| 16-token run, load included (best of runs) | {run:.2f} s ({run - imp:+.2f} s over the import) | within 3 s of the import | {'yes' if run - imp <= 3 else 'no'} |")
try:
    v = float(pp)
    print(f"| pp512 (median of the repeats) | {v:.1f} tok/s | >= 50 tok/s | {'yes' if v >= 50 else 'no'} |")
except ValueError:
    print(f"| pp512 | {pp} | >= 50 tok/s | ? |")
PY
