# Sourced by benchmarks/gpu_check.sh: the gate's units (one CUDA test file, one bench command),
# each run under the call's deadline and remembered once it passed on this very tree, so that a
# second call on the same warm device machine resumes where a call cut at its limit stopped.
#
#   gate_tree_id PATH...        a short hash of every file under PATH (caches left out): the key
#                               of the state, so a changed tree never reuses an earlier pass
#   gate_start STATE_ROOT SECONDS  state folder $GATE_STATE (STATE_ROOT/<tree id>) and the
#                               deadline, SECONDS from now
#   unit NAME CMD...            0: passed, now or in an earlier call on this tree; 1: failed;
#                               2: not run or cut by the deadline (appended to $GATE_CUT)
# A unit's command runs under `timeout` with the time left, so a cut unit still leaves the
# summary and the verdict line in the log (a command that itself exits 124 reads as cut); one is
# not started with GATE_MIN_LEFT seconds (default 5) or fewer left.
gate_tree_id() {
  find "$@" -type f ! -path '*/__pycache__/*' ! -path '*/.pytest_cache/*' ! -name '*.pyc' -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}

gate_start() {
  GATE_TREE=$(gate_tree_id "${GATE_PATHS[@]}")
  GATE_STATE="$1/$GATE_TREE"
  mkdir -p "$GATE_STATE"
  GATE_DEADLINE=$(( $(date +%s) + $2 ))
  GATE_CUT=(); GATE_RESUMED=0; GATE_TIMES=()
}

unit() {
  local name=$1; shift
  local mark="$GATE_STATE/$(printf %s "$name" | tr -c 'A-Za-z0-9._-' _)"
  if [ -e "$mark" ]; then
    echo "= $name: passed in an earlier call on tree $GATE_TREE ($(cat "$mark")): not run again"
    GATE_RESUMED=$((GATE_RESUMED + 1)); return 0
  fi
  local left=$(( GATE_DEADLINE - $(date +%s) ))
  if [ "$left" -le "${GATE_MIN_LEFT:-5}" ]; then
    echo "= $name: not run (the deadline)"; GATE_CUT+=("$name"); return 2
  fi
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$left" "$@"; local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  GATE_TIMES+=("${dt}s $name")
  if [ "$rc" -eq 0 ]; then
    echo "${dt}s" > "$mark"; echo "= $name: passed in ${dt}s"; return 0
  fi
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "= $name: cut by the deadline after ${dt}s"; GATE_CUT+=("$name"); return 2
  fi
  echo "= $name: FAILED (exit $rc) in ${dt}s"; return 1
}
