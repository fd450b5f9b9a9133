"""Wall time of `agl plugins` (imports and validates every installed plugin) against `agl --help` (the CLI alone).

Each command runs ``--repeats`` times as a fresh process, as a user runs it
(`python -m timeit`-style: the median and the best are reported). A separate
process loads the plugin set the same way and reports which heavy modules
(torch, tensordict, transformers, verl, ray, peft) importing the plugins
pulled in, and which plugin's import pulled each one first: the goal is none,
and `agl plugins` at or under 1.5 s on a quiet machine.

    python benchmarks/bench_plugins_cli.py [--repeats 5]

prints one JSON line:

    {"bench": "plugins_cli", "plugins_s": ..., "plugins_best_s": ..., "help_s": ..., "ratio": ...,
     "plugins_cpu_s": ..., "help_cpu_s": ..., "goal_s": 1.5, "heavy_imported": {...}, "plugins": N, "repeats": R}

(``*_s`` are median wall times, ``*_cpu_s`` median user + system CPU times, ``ratio`` the wall-time ratio.)
"""

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEAVY = ("torch", "tensordict", "transformers", "verl", "ray", "peft")
GOAL_S = 1.5

PROBE = f"""
import json, sys
from agl_core import plugins as P

first = {{}}
load = P.importlib_metadata.EntryPoint.load

def traced_load(ep):
    before = {{m for m in {HEAVY!r} if m in sys.modules}}
    try:
        return load(ep)
    finally:
        for m in {HEAVY!r}:
            if m in sys.modules and m not in before:
                first.setdefault(m, ep.name)

P.importlib_metadata.EntryPoint.load = traced_load
pset = P.PluginSet.load()
print(json.dumps({{"heavy": first, "plugins": len(pset.plugins)}}))
"""


def agl_executable() -> str:
    return shutil.which("agl") or str(Path(sys.executable).with_name("agl"))


def run_times(argv: list[str], repeats: int) -> tuple[list[float], list[float]]:
    """(wall seconds, CPU seconds: user + system) of each of ``repeats`` runs of ``argv``.

    The CPU time moves less than the wall time on a loaded machine: both are reported.
    """
    walls, cpus = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return walls, cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    agl = agl_executable()
    run_times([agl, "plugins", "--json"], 1)  # warm the file cache (and .pyc files) once, untimed
    plugins, plugins_cpu = run_times([agl, "plugins", "--json"], args.repeats)
    help_, help_cpu = run_times([agl, "--help"], args.repeats)
    probe = json.loads(subprocess.run([sys.executable, "-c", PROBE], check=True, capture_output=True,
                                      text=True).stdout)
    median, floor = statistics.median(plugins), statistics.median(help_)
    print(json.dumps({"bench": "plugins_cli", "plugins_s": round(median, 3), "plugins_best_s": round(min(plugins), 3),
                      "help_s": round(floor, 3), "ratio": round(median / floor, 2),
                      "plugins_cpu_s": round(statistics.median(plugins_cpu), 3),
                      "help_cpu_s": round(statistics.median(help_cpu), 3), "goal_s": GOAL_S,
                      "heavy_imported": probe["heavy"], "plugins": probe["plugins"], "repeats": args.repeats}))


if __name__ == "__main__":
    main()
