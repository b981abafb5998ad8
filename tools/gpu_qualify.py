"""GPU qualification in one call: environment, CUDA tests, parity and benchmarks, one table last.

Run on a CUDA machine from the repository root (it builds the Cython extensions first):

    python3 setup.py -q build_ext --inplace && python3 tools/gpu_qualify.py [--out DIR] [--shapes 135m,8b]

Steps: (1) versions of torch, CUDA, CuPy, Triton, transformers; (2) pytest
tests/execution (CPU frame logic) and tests/cuda (Triton attention against a
float64 reference, GraphExecutor qualification: capacities, physical-slot
scatter, two frames, prefix restore, sampling, poison, teardown; raw replay:
repetitions, inputs between completions, capacity, owner retention,
destructor draining); (3) tools/bench_gpu.py: token parity and benchmarks
beside transformers. Full logs go to --out (default $OUT or ./gpu-out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def versions() -> dict:
    info = {}
    for name in ("torch", "cupy", "triton", "transformers", "numpy", "safetensors", "gguf"):
        try:
            mod = __import__(name)
            info[name] = getattr(mod, "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - report what is missing
            info[name] = f"missing ({type(exc).__name__})"
    try:
        import torch

        info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
        info["cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001
        pass
    return info


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "gpu-out"))
    ap.add_argument("--shapes", default="135m,8b")
    ap.add_argument("--skip-tests", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    summary = {"versions": versions()}
    print("versions:", json.dumps(summary["versions"]), flush=True)

    if not args.skip_tests:
        t = time.perf_counter()
        with open(out / "pytest.log", "w") as log:
            rc = subprocess.call([sys.executable, "-m", "pytest", "tests/execution", "tests/cuda", "-q", "-x",
                                  "-p", "no:cacheprovider", "-rs", "--tb=short"], cwd=ROOT, env=env,
                                 stdout=log, stderr=subprocess.STDOUT)
        tail = (out / "pytest.log").read_text().strip().splitlines()[-25:]
        summary["pytest_rc"] = rc
        summary["pytest_s"] = round(time.perf_counter() - t, 1)
        print("\n".join(tail), flush=True)

    t = time.perf_counter()
    with open(out / "bench.log", "w") as log:
        proc = subprocess.run([sys.executable, "tools/bench_gpu.py", "--shapes", args.shapes, "--json"], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    (out / "bench.txt").write_text(proc.stdout)
    summary["bench_rc"] = proc.returncode
    summary["bench_s"] = round(time.perf_counter() - t, 1)
    lines = proc.stdout.strip().splitlines()
    if lines and lines[-1].startswith("{"):
        summary["bench"] = json.loads(lines[-1])
        lines = lines[:-1]
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if proc.returncode:
        print((out / "bench.log").read_text()[-3000:])
    print(f"\npytest rc={summary.get('pytest_rc')} ({summary.get('pytest_s')} s); "
          f"bench rc={proc.returncode} ({summary['bench_s']} s)")
    print("\n".join(lines))
    return 0 if summary.get("pytest_rc", 0) == 0 and proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
