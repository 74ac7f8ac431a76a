#!/usr/bin/env bash
# Build dist/strata-gui (PyInstaller, one folder) and prove it: the frozen app's own
# `--selftest --screenshot` on the offscreen platform.  Exits non-zero when either fails.
#
#   packaging/build.sh              check the exclusions, build, run the frozen self-test
#   packaging/build.sh --test-only  only the frozen self-test of an existing dist/strata-gui
#
# PYTHON picks the interpreter (default .venv/bin/python, which needs the `package` extra:
# pip install -e ".[package]").  STRATA_BUNDLE_TRIM=0 builds the untrimmed baseline.
# The self-test writes build/frozen-selftest/selftest.png and selftest.log; the demo model is
# generated afresh into build/frozen-selftest/cache (XDG_CACHE_HOME), by the frozen app itself.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
APP=dist/strata-gui
OUT=build/frozen-selftest
build=1
case "${1:-}" in
  --test-only) build=0 ;;
  "") ;;
  *) echo "usage: packaging/build.sh [--test-only]" >&2; exit 2 ;;
esac

if (( build )); then
  if ! "$PY" -m PyInstaller --version >/dev/null 2>&1; then
    echo "build.sh: no PyInstaller in $PY; install it with: $PY -m pip install -e '.[package]'" >&2
    exit 2
  fi
  echo "build.sh: the app with the left-out modules blocked, in this interpreter (seconds)"
  QT_QPA_PLATFORM=offscreen HF_HUB_OFFLINE=1 "$PY" packaging/check_excludes.py
  echo "build.sh: PyInstaller $("$PY" -m PyInstaller --version) building $APP"
  t0=$SECONDS
  "$PY" -m PyInstaller --noconfirm --log-level WARN --distpath dist --workpath build/pyinstaller \
    packaging/strata_gui.spec
  echo "build.sh: build took $((SECONDS - t0)) s"
fi

for prog in strata-gui strata-bench; do
  if [[ ! -x "$APP/$prog" ]]; then
    echo "build.sh: $APP/$prog is missing; build first" >&2
    exit 1
  fi
done
# the console program answers in the shell (the windowed one cannot)
usage="$("$APP/strata-bench" --help 2>&1 || true)"
if [[ "$usage" != *"usage: strata-bench"* ]]; then
  echo "build.sh: $APP/strata-bench --help did not print its usage" >&2
  exit 1
fi
echo "build.sh: $APP/strata-bench --help prints its usage"
echo "build.sh: $APP is $(du -sm "$APP" | cut -f1) MiB ($(find "$APP" -type f | wc -l) files); largest parts (MiB):"
du -sm "$APP"/_internal/* | sort -rn | sed 's/^/  /' | awk 'NR <= 8'  # awk reads all: no SIGPIPE under pipefail

rm -rf "$OUT"
mkdir -p "$OUT"
t0=$SECONDS
set +e
env QT_QPA_PLATFORM=offscreen XDG_CACHE_HOME="$PWD/$OUT/cache" XDG_CONFIG_HOME="$PWD/$OUT/config" \
  timeout 600 "$APP/strata-gui" --selftest --screenshot "$OUT/selftest.png"
rc=$?
set -e
echo "build.sh: frozen self-test exit code $rc after $((SECONDS - t0)) s; log:"
sed 's/^/  /' "$OUT/selftest.log" 2>/dev/null || echo "  (no $OUT/selftest.log)"
if (( rc != 0 )) || ! grep -q "selftest: PASSED" "$OUT/selftest.log" 2>/dev/null || [[ ! -s "$OUT/selftest.png" ]]; then
  echo "build.sh: FROZEN SELF-TEST FAILED" >&2
  exit 1
fi
echo "build.sh: frozen self-test passed; screenshot $OUT/selftest.png"
