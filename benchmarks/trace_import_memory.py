"""Peak memory and time of importing a trace into a history, in a fresh process.

    python benchmarks/trace_import_memory.py --kind saved --events 1000000 [--gz]
    python benchmarks/trace_import_memory.py --kind minimal --events 4900000 [--gz]
    python benchmarks/trace_import_memory.py --kind saved --events 200000 --what load

`saved`: slices as `engine.io.trace.save` writes them (exact args); `minimal`: foreign slices of about 50
bytes (`{"ph":"X","ts":..,"dur":1,"pid":1,"cat":"compute"}`).  The child process measures the peak RSS
(VmHWM) of `run_files.import_trace` followed by `RunHistory.add`, above its RSS before the import.
"""
from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import sys, time, json
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from strata_gui.run import run_files
from strata_gui.history.history_model import RunHistory
from engine.io.trace import TraceError
def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
def hwm_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
h = RunHistory(Path(sys.argv[2]))
base = rss_kib()
t0 = time.perf_counter()
try:
    if sys.argv[4] == "load":
        from engine.io import trace
        events, meta = trace.load(sys.argv[1])
        outcome = f"loaded {len(events)} events"
    else:
        rec = run_files.import_trace(sys.argv[1])
        run = h.add(rec)
        outcome = f"imported as #{run}: {len(rec.events)} events"
except TraceError as exc:
    outcome = f"refused: {exc.problem}"
took = time.perf_counter() - t0
peak = hwm_kib()  # not ru_maxrss: Linux keeps the forking parent's peak in it across exec
print(json.dumps({"outcome": outcome, "seconds": round(took, 2), "base_rss_mib": round(base / 1024, 1),
                  "peak_rss_mib": round(peak / 1024, 1), "peak_above_base_mib": round((peak - base) / 1024, 1)}))
"""


def write(path: Path, kind: str, n: int, gz: bool) -> int:
    opener = gzip.open if gz else open
    json_bytes = 0
    with opener(path, "wb") as fh:
        def put(s: str) -> None:
            nonlocal json_bytes
            b = s.encode()
            json_bytes += len(b)
            fh.write(b)
        put('{"traceEvents":[')
        for i in range(n):
            sep = "," if i else ""
            if kind == "minimal":
                put(f'{sep}{{"ph":"X","ts":{i},"dur":1,"pid":1,"cat":"compute"}}')
            else:
                s, c = i % 4, i // 4
                t = 1_700_000_000_000_000_000 + i * 1000
                put(f'{sep}{{"ph":"X","pid":{s + 1},"tid":1,"name":"C{c}","cat":"compute","ts":{i},"dur":1.0,'
                    f'"args":{{"run_id":"r1","stage":{s},"device":"cuda:{s}","chunk":{c},"kind":"compute",'
                    f'"start_ns":{t},"end_ns":{t + 900},"tokens":512,"nbytes":0,"note":""}}}}')
        put('],"otherData":{}}')
    return json_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=("saved", "minimal"), default="saved")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--gz", action="store_true")
    ap.add_argument("--what", choices=("import", "load"), default="import",
                    help="import: run_files.import_trace + RunHistory.add; load: engine.io.trace.load alone")
    ns = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("t.json.gz" if ns.gz else "t.json")
        json_bytes = write(path, ns.kind, ns.events, ns.gz)
        out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(Path(tmp) / "h.sqlite3"), str(root),
                              ns.what],
                             capture_output=True, text=True, check=True)
        res = json.loads(out.stdout)
        res.update(kind=ns.kind, events=ns.events, file_mib=round(path.stat().st_size / 2**20, 1),
                   json_mib=round(json_bytes / 2**20, 1))
        res["peak_over_json"] = round(res["peak_above_base_mib"] / max(res["json_mib"], 1e-9), 2)
        print(json.dumps(res))


if __name__ == "__main__":
    main()
