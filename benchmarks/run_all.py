"""`make bench`: runs every benchmarks/bench_*.py in turn (each prints its table and writes JSON)."""
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    for script in sorted(HERE.glob("bench_*.py")):
        print(f"\n######## {script.name}")
        runpy.run_path(str(script), run_name="__main__")
