"""Learning from a teacher on the default game: RL alone vs on-policy distillation vs SFT then RL; the teacher
stage's cost; ``agl eval`` against a validation pass.

1. **RL alone**: ``examples/guess_number/recipe.yaml`` per seed (``bench_learning.run_seed``: a fresh process,
   wall-clock from its launch). Its first seed's trained model, exported, is the teacher (or ``--teacher DIR``).
2. **Distillation**: ``recipe_distill.yaml`` per seed, a fresh student taught by that teacher.
3. **SFT then RL**: per seed, ``recipe_sft.yaml`` for ``--sft-steps`` steps on the teacher run's won games
   (its SQLite store), exported, then ``recipe.yaml`` from those weights; its seconds are the SFT run's wall
   time plus the RL run's time to the target.

For each: steps and seconds to validation reward ``--target`` (0.9), per seed. No goal on learning speed.

4. **The teacher stage's cost** on one batch of the default recipe's shape (7 tasks x 24 games, prompts of 12
   and responses of 48 tokens, random ids), embedded backend: the teacher stage of a ``model_path`` teacher
   (``LocalTeacher``, in the trainer's process) beside the ``old_log_prob`` stage's forward (log-probs and
   entropy, the student's backend) on the same rows, and the same teacher as an endpoint over HTTP
   (``TeacherScorer``, the embedded endpoint's scoring route, packed log-probs); medians of ``--repeats``, in
   wall-clock seconds and (``cpu_…``) CPU seconds of the process. Goal: ratio <= 1.
5. **``agl eval`` throughput** on the validation tasks (the teacher as ``--checkpoint``, ``--eval-n`` rollouts a
   task) beside the RL runs' validation passes inside training (``timing_s/validate``, median): rollouts per
   second of each. Goal: ratio >= 1.

Prints one JSON line. ``--quick`` runs a tiny version (1 seed, 2 steps) to check that everything works;
``--cost-only`` runs part 4 alone (seconds, no training), on ``--teacher`` or on the default recipe's model made
from its config (random weights: the cost does not depend on them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_learning import ROOT, TARGET, read_records, run_seed  # noqa: E402

EXAMPLE = ROOT / "examples" / "guess_number"


def agl(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "agl_core.cli", *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def arm(name: str, work: Path, seeds: list[int], recipe: Path, overrides: list[str]) -> list[dict]:
    runs = []
    for seed in seeds:
        run_dir = work / name / f"seed{seed}" / "run"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        runs.append({**run_seed(seed, run_dir, overrides, recipe), "run_dir": str(run_dir)})
        print(f"{name} seed {seed}: {json.dumps(runs[-1])}", file=sys.stderr)
    return runs


def figures(runs: list[dict]) -> dict:
    return {"steps_to_target": [r["step_to_target"] for r in runs],
            "seconds_to_target": [r["time_to_target_s"] for r in runs],
            "end_val_reward": [r["end_val_reward"] for r in runs]}


def teacher_cost(teacher: Path, repeats: int) -> dict:
    """Seconds of the teacher stage (a model_path teacher in the trainer's process, and the same model as an
    endpoint over HTTP) and of the old_log_prob forward on one batch of the default recipe's shape."""
    import torch

    from agl_plugin_teachers.endpoints import Served
    from agl_plugin_teachers.settings import TeacherConfig
    from agl_plugin_teachers.teacher import LocalTeacher, TeacherScorer
    from agl_plugin_torch.backend import create
    from agl_plugin_torch.settings import TorchConfig
    from agl_plugin_torch.testing import rows

    torch.set_num_threads(1)  # the recipe's plugins.torch.num_threads
    with tempfile.TemporaryDirectory() as tmp:
        backend = create(TorchConfig.model_validate({"model": {"path": str(teacher)}, "num_threads": 1}), Path(tmp),
                         seed=0, with_critic=False)
        generator = torch.Generator().manual_seed(0)
        vocab = len(backend.tokenizer)
        prompts = [torch.randint(3, vocab, (12,), generator=generator).tolist() for _ in range(168)]
        responses = [torch.randint(3, vocab, (48,), generator=generator).tolist() for _ in range(168)]
        batch = rows(prompts, responses, prompt_width=12, response_width=48)
        config = TeacherConfig(model_path=str(teacher), rows_per_request=64, concurrency=2)
        local = LocalTeacher(config, 64)  # forward_micro_batch_size's default: what old_log_prob uses
        endpoint = TeacherScorer(Served(config, "teacher"), 64)
        timings = {"old_log_prob": [], "local": [], "endpoint": []}
        cpu = {name: [] for name in timings}
        stages = {"old_log_prob": lambda: backend.logprobs(backend.actor, batch, with_entropy=True),
                  "local": lambda: local.score_batch(batch), "endpoint": lambda: endpoint.score_batch(batch)}
        try:
            for _ in range(repeats + 1):  # the first of each is a warm-up
                for name, stage in stages.items():
                    start, start_cpu = time.perf_counter(), time.process_time()
                    stage()
                    timings[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
        finally:
            endpoint.close()
    old, local_s, endpoint_s = (statistics.median(timings[k][1:]) for k in ("old_log_prob", "local", "endpoint"))
    old_cpu, local_cpu, endpoint_cpu = (statistics.median(cpu[k][1:]) for k in ("old_log_prob", "local", "endpoint"))
    # CPU seconds of the whole process (the in-process endpoint's threads included): steadier than wall-clock
    # seconds on a machine other work shares.
    return {"rows": 168, "old_log_prob_s": round(old, 4), "teacher_s": round(local_s, 4),
            "teacher_over_old_log_prob": round(local_s / old, 3), "teacher_endpoint_s": round(endpoint_s, 4),
            "teacher_endpoint_over_old_log_prob": round(endpoint_s / old, 3),
            "cpu_teacher_over_old_log_prob": round(local_cpu / old_cpu, 3),
            "cpu_teacher_endpoint_over_old_log_prob": round(endpoint_cpu / old_cpu, 3)}


def default_model(out: Path) -> Path:
    """The default recipe's model, made from its ``plugins.torch.model`` section (seed 0) into ``out``."""
    import yaml

    from agl_plugin_torch.modeling import create
    from agl_plugin_torch.settings import ModelConfig

    section = yaml.safe_load((EXAMPLE / "recipe.yaml").read_text())["plugins"]["torch"]["model"]
    return create(ModelConfig.model_validate(section), out, seed=0)


def eval_throughput(teacher: Path, rl_runs: list[dict], work: Path, n: int) -> dict:
    """Rollouts per second of ``agl eval`` on the validation tasks (``n`` each) and of the RL runs' validation
    passes (every one, the first included: both start cold)."""
    from agl_plugin_teachers.evaluation import evaluate

    summary = evaluate(str(EXAMPLE / "recipe.yaml"), [], [], checkpoint=str(teacher), split="val", n=n,
                       out=work / "eval" / "teacher.jsonl")
    passes = [r["timing_s/validate"] for run in rl_runs for r in read_records(Path(run["run_dir"]) / "metrics.jsonl")
              if "timing_s/validate" in r]
    n_val = summary["n_tasks"]
    in_training = n_val / statistics.median(passes) if passes else None
    return {"eval_rollouts": summary["n_rollouts"], "val_rollouts": n_val, "eval_rollouts_per_s": round(summary["rollouts_per_s"], 2),
            "validate_rollouts_per_s": None if in_training is None else round(in_training, 2),
            "eval_over_validate": None if in_training is None else round(summary["rollouts_per_s"] / in_training, 3),
            "eval_reward_mean": summary["reward_mean"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=80, help="training steps of each run")
    parser.add_argument("--test-freq", type=int, default=5)
    parser.add_argument("--sft-steps", type=int, default=20)
    parser.add_argument("--teacher", type=Path, help="a teacher model directory (default: RL seed 0's, exported)")
    parser.add_argument("--repeats", type=int, default=5, help="timings of the teacher-cost comparison")
    parser.add_argument("--eval-n", type=int, default=8, help="agl eval's rollouts per validation task")
    parser.add_argument("--quick", action="store_true", help="1 seed, 2 steps, 1 SFT step: a check, not figures")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temporary one)")
    parser.add_argument("--cost-only", action="store_true", help="part 4 alone: the teacher stage's cost")
    args = parser.parse_args()
    if args.cost_only:
        with tempfile.TemporaryDirectory() as tmp:
            teacher = args.teacher or default_model(Path(tmp) / "teacher")
            print(json.dumps({"bench": "teachers", "teacher_cost": teacher_cost(teacher, args.repeats)}))
        return
    if args.quick:
        args.seeds, args.max_steps, args.test_freq, args.sft_steps, args.repeats = [args.seeds[0]], 2, 1, 1, 1
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-teachers-"))
    common = [f"trainer.total_steps={args.max_steps}", f"trainer.test_freq={args.test_freq}",
              f"trainer.save_freq={args.max_steps}"]
    rl = arm("rl", work, args.seeds, EXAMPLE / "recipe.yaml", common)
    teacher_run = Path(rl[0]["run_dir"])
    teacher = args.teacher
    if teacher is None:
        teacher = work / "teacher"
        agl("export", str(teacher_run), "--merged", str(teacher))
    distill = arm("distill", work, args.seeds, EXAMPLE / "recipe_distill.yaml",
                  [*common, f"plugins.distill.teacher.model_path={teacher}"])
    sft_rl = []
    for seed in args.seeds:
        sft = arm("sft", work, [seed], EXAMPLE / "recipe_sft.yaml",
                  [f"trainer.total_steps={args.sft_steps}", f"trainer.save_freq={args.sft_steps}",
                   f"plugins.transcripts.store={teacher_run / 'rollouts.sqlite'}"])[0]
        warm = work / "sft" / f"seed{seed}" / "model"
        agl("export", sft["run_dir"], "--merged", str(warm))
        then = arm("sft_rl", work, [seed], EXAMPLE / "recipe.yaml",
                   [*common, f"plugins.torch.model.path={warm}", "plugins.torch.model.build=null"])[0]
        reached = then["time_to_target_s"]
        sft_rl.append({**then, "sft_wall_s": sft["wall_s"],
                       "time_to_target_s": None if reached is None else round(sft["wall_s"] + reached, 1)})
    result = {"bench": "teachers", "target": TARGET, "seeds": args.seeds, "max_steps": args.max_steps,
              "sft_steps": args.sft_steps, "rl": figures(rl), "distill": figures(distill),
              "sft_then_rl": {**figures(sft_rl), "sft_wall_s": [r["sft_wall_s"] for r in sft_rl]},
              "teacher_cost": teacher_cost(teacher, args.repeats),
              "eval": eval_throughput(teacher, rl, work, args.eval_n), "quick": args.quick}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
