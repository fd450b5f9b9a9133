"""The GPU smoke scripts' dry runs on a CPU: the same steps and the same checker, a tiny model.

``scripts/gpu_smoke.sh`` with ``AGL_SMOKE_DEVICE=cpu`` runs its phases (three steps with validation and a checkpoint,
a resume, LoRA) on the embedded backend instead of verl and vLLM, which need a GPU; its memory-trace phase is
skipped. ``scripts/gpu_smoke_embedded.sh`` with ``AGL_SMOKE_DEVICE=cpu`` trains the default game with a tiny Qwen2-shaped
model, checks the run with ``scripts/check_run.py`` and benchmarks the engine, as it does with the 0.5B model on a
GPU (its CUDA-graph benchmark excepted). ``scripts/source_dists.py`` makes the checkout's distributions
discoverable without installing them, as the bare GPU image needs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_embedded_gpu_smoke_dry_run_passes_and_writes_its_figures(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "AGL_SMOKE_DEVICE": "cpu", "PYTHON": sys.executable,
           "WHEELS": str(tmp_path / "no_wheels"), "AGL_SMOKE_WORK": str(tmp_path / "work")}
    done = subprocess.run(["bash", "scripts/gpu_smoke_embedded.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "GPU SMOKE (embedded): PASS" in done.stdout and "all checks passed" in done.stdout
    figures = json.loads((out / "gpu_smoke_embedded.json").read_text())
    assert figures["check_run_rc"] == 0 and len(figures["run"]["steps"]) == 2
    step = figures["run"]["steps"][-1]
    assert step["gen_engine_tokens"] > 0 and step["gen_tokens_per_s"] > 0 and step["update_tokens_per_s"] > 0
    assert 0.9 <= step["tis_mean"] <= 1.1
    kinds = {(g["kv_cache"], g["compiled"]) for g in figures["bench"]["generation"]}
    assert kinds == {("dynamic", False), ("static", False)} and figures["bench"]["update"]["tokens_per_s"] > 0
    assert (out / "metrics.jsonl").is_file() and (out / "summary.txt").is_file()


def test_the_verl_gpu_smoke_dry_run_passes_every_phase(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "AGL_SMOKE_DEVICE": "cpu", "PYTHON": sys.executable,
           "AGL_SMOKE_WORK": str(tmp_path / "work")}
    done = subprocess.run(["bash", "scripts/gpu_smoke.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "GPU SMOKE (verl): PASS" in done.stdout
    for phase in "ABC":
        assert f"check {phase}: PASS" in done.stdout
    assert "PASS  resumed from step 3's weights" in (out / "check_B.txt").read_text()
    assert "PASS  the LoRA adapter trained" in (out / "check_C.txt").read_text()


def test_an_unusable_machine_exits_2(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "AGL_SMOKE_DEVICE": "cuda", "PYTHON": sys.executable,
           "WHEELS": str(tmp_path / "no_wheels"), "AGL_SMOKE_WORK": str(tmp_path / "work")}
    done = subprocess.run(["bash", "scripts/gpu_smoke_embedded.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "UNUSABLE" in done.stdout


def test_source_dists_make_the_checkout_discoverable_without_an_install(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "scripts/source_dists.py", str(site), str(REPO),
                           str(REPO / "plugins" / "agl-plugin-torch")], cwd=REPO, capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == f"{REPO}:{REPO / 'plugins' / 'agl-plugin-torch'}"
    probe = ("import importlib.metadata as md, sys; sys.path[:0] = sys.argv[1:]; "
             "d = md.distribution('agl-plugin-torch'); "
             "print(d.version, sorted(e.name for e in d.entry_points), "
             "sorted(e.name for e in md.distribution('agl-core').entry_points if e.group == 'agl_core.plugins'))")
    found = subprocess.run([sys.executable, "-S", "-c", probe, str(site)], capture_output=True, text=True,
                           check=True).stdout
    assert found.startswith("0.1.0 ['torch']") and "'local_runner'" in found and "'estimators'" in found
