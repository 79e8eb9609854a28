"""How long the README's `make demo` takes on a fresh clone.

    .venv/bin/python scripts/demo_time.py                 # clone this repository, time `make demo`
    .venv/bin/python scripts/demo_time.py --log FILE      # or read a log of that run made with
                                                          # `/usr/bin/time -v make demo > FILE 2>&1`

The timed run clones the repository's HEAD into a temporary folder and runs `make demo` there
under GNU time (it compiles llama-cpp-python unless pip's cache already holds the wheel: the
report says whether the log shows a compile). Writes results/demo-time.json (append-only).
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse(log: str) -> dict:
    def field(name):
        m = re.search(rf"^\s*{re.escape(name)}: (.+)$", log, re.M)
        if not m:
            raise SystemExit(f"the log has no '{name}' line: not a `/usr/bin/time -v make demo` log")
        return m.group(1).strip()

    wall = field("Elapsed (wall clock) time (h:mm:ss or m:ss)")
    parts = [float(p) for p in wall.split(":")]
    seconds = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    return {"wall_s": round(seconds, 1), "user_s": float(field("User time (seconds)")),
            "system_s": float(field("System time (seconds)")), "exit_status": int(field("Exit status")),
            "compiled_llama_cpp_python": "Building wheel for llama-cpp-python" in log,
            "demo_output": [ln for ln in log.splitlines() if ln.startswith("[")][:2]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", default=None)
    ap.add_argument("--commit", default=None, help="with --log: the commit that log's clone was at")
    a = ap.parse_args()

    from edgespec.io import write_result
    from edgespec.measure.bench import machine_info

    commit = a.commit
    if a.log:
        log = Path(a.log).read_text(errors="replace")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["git", "clone", "-q", str(ROOT), f"{tmp}/repo"], check=True)
            res = subprocess.run(["/usr/bin/time", "-v", "make", "demo"], cwd=f"{tmp}/repo",
                                 capture_output=True, text=True)
            log = res.stdout + res.stderr
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    doc = {"command": "git clone && make demo", "commit": commit, **parse(log), "machine": machine_info(2)}
    print(doc)
    print("wrote", write_result(ROOT / "results", "demo-time", doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
