# Sourced by the GPU benchmark scripts: unbuffered output, the repo on PYTHONPATH, the wheels the
# device machine lacks (carried in .whl/) installed beside it, $OUTDIR for traces, the model.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
if [ -d .whl ]; then  # installed once per machine: a second script of a warm machine's call reuses it
  WHEELS=$(cd .whl && ls ./*.whl | sort | tr '\n' ' ')
  if [ "$(cat /tmp/site/.wheels 2>/dev/null)" = "$WHEELS" ] \
     || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
          && echo "$WHEELS" > /tmp/site/.wheels; }; then
    export PYTHONPATH=.:/tmp/site
  fi
fi
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
M=${MODEL:-synthetic:qwen3-30b-a3b:n_layers=32}
section() { echo; echo "## $*"; echo; }
