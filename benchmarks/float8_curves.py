"""FP8 linears against bf16 over a training run: the loss curves of each recipe on the same data.

    python -m benchmarks.float8_curves OUT [--steps 300] [--models llama3,deepseek_v3]
        [--recipes tensorwise,rowwise,rowwise_with_gw_hp,experts,experts_dispatch] [--parallel 2]

(``experts``: rowwise_with_gw_hp with DeepSeek-V3's routed experts in FP8 too,
``--float8.convert_routed_experts``; ``experts_dispatch``: the same on two processes with expert
parallel sending the experts' rows in float8, ``--parallelism.ep 2 --float8.dispatch_in_float8``,
half the batch each: the one process's global batch. DeepSeek-V3 only.)

For each model's debug config it trains one bf16 job (``training.mixed_precision_param
bfloat16``, fp32 master weights, the linears in bf16) and one job per FP8 recipe
(``--float8.recipe_name``, the rest identical: same seed, same synthetic batches, one process on
the CPU), ``--parallel`` jobs at a time with one thread each, then compares each FP8 curve with
the bf16 one: the final loss, the mean of the last 10% of the steps (the final loss of one batch
is noisy), their relative gaps, and the largest per-step relative gap after the first 10% of the
steps (the first steps' losses fall fast, so a one-step shift there is a large gap that says
nothing about the run). Writes OUT/float8_curves.json (every curve and figure) and prints the
table. The measurements and the bound they support are in docs/numerics.md ("FP8 linears").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tomli

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"llama3": "configs/llama3_debug.toml", "deepseek_v3": "configs/deepseek_v3_debug.toml"}
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "experts", "experts_dispatch")
_EXPERTS = ["--float8.recipe_name", "rowwise_with_gw_hp", "--float8.convert_routed_experts"]
FLAGS = {
    "experts": _EXPERTS,
    "experts_dispatch": [*_EXPERTS, "--float8.dispatch_in_float8", "--parallelism.ep", "2"],
}
"""The flags of a recipe that is not a ``float8.recipe_name`` alone."""
PROCESSES = {"experts_dispatch": 2}
"""Processes of a recipe's job where more than one; each takes its share of the global batch."""
ONLY_DEEPSEEK = ("experts", "experts_dispatch")


def config_batch(model: str) -> int:
    """The model's debug config's ``training.local_batch_size``: its curves' global batch."""
    return tomli.loads((ROOT / CONFIGS[model]).read_text())["training"]["local_batch_size"]


def job(out: Path, model: str, recipe: str, steps: int) -> list[str]:
    """The train.py command of one curve (recipe 'none': bf16 linears)."""
    processes = PROCESSES.get(recipe, 1)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    split = ["--training.local_batch_size", str(config_batch(model) // processes)] if processes > 1 else []
    return [
        sys.executable,
        *(launcher if processes > 1 else []),
        str(ROOT / "train.py"),
        *("--job.config_file", CONFIGS[model], "--job.device", "cpu"),
        *("--job.dump_folder", str(out / f"{model}_{recipe}")),
        *("--training.steps", str(steps), "--training.mixed_precision_param", "bfloat16"),
        *split,
        *FLAGS.get(recipe, ["--float8.recipe_name", recipe]),
        *("--metrics.log_freq", "50", "--metrics.enable_tensorboard", "False", "--checkpoint.interval", "0"),
    ]


def run(command: list[str], log: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(log, "w") as f:
        subprocess.run(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, check=True)


def losses(folder: Path) -> list[float]:
    return [float(line.split()[1]) for line in (folder / "losses.txt").read_text().splitlines()]


def compare(fp8: list[float], bf16: list[float]) -> dict:
    """The gaps of one FP8 curve against the bf16 one (module docstring)."""
    tail = max(1, len(bf16) // 10)
    mean_fp8, mean_bf16 = sum(fp8[-tail:]) / tail, sum(bf16[-tail:]) / tail
    later = range(tail, len(bf16))
    return {
        "final_loss": fp8[-1],
        "final_gap": (fp8[-1] - bf16[-1]) / bf16[-1],
        "tail_mean": mean_fp8,
        "tail_mean_gap": (mean_fp8 - mean_bf16) / mean_bf16,
        "largest_step_gap": max(abs(fp8[i] - bf16[i]) / bf16[i] for i in later) if later else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--models", default="llama3,deepseek_v3")
    parser.add_argument("--recipes", default=",".join(RECIPES[:3]))
    parser.add_argument("--parallel", type=int, default=2)
    opts = parser.parse_args()
    models, recipes = opts.models.split(","), opts.recipes.split(",")
    for name, allowed, given in (("--models", CONFIGS, models), ("--recipes", RECIPES, recipes)):
        if bad := [g for g in given if g not in allowed]:
            parser.error(f"{name}: {', '.join(bad)} not one of {', '.join(allowed)}")
    out = opts.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if set(ONLY_DEEPSEEK) & set(recipes) and models != ["deepseek_v3"]:
        only = ", ".join(ONLY_DEEPSEEK)
        parser.error(f"--recipes {only}: only deepseek_v3 has routed experts (pass --models deepseek_v3)")
    runs = [(m, r) for m in models for r in ("none", *recipes)]
    start = time.perf_counter()
    with ThreadPoolExecutor(opts.parallel) as pool:
        list(pool.map(lambda mr: run(job(out, *mr, opts.steps), out / f"{mr[0]}_{mr[1]}.log"), runs))
    result = {"steps": opts.steps, "wall_s": time.perf_counter() - start, "models": {}}
    print(f"FP8 linears vs bf16, {opts.steps} steps, CPU, the config's batch each step ({result['wall_s']:.0f} s)")
    print("| model | recipe | final loss | final gap | last-10% mean gap | largest step gap after 10% |")
    print("|---|---|---|---|---|---|")
    for model in models:
        bf16 = losses(out / f"{model}_none")
        entry = {"bf16": bf16, "recipes": {}}
        print(f"| {model} | bf16 | {bf16[-1]:.4f} | | | |")
        for recipe in recipes:
            curve = losses(out / f"{model}_{recipe}")
            figures = compare(curve, bf16)
            entry["recipes"][recipe] = {"losses": curve, **figures}
            print(
                f"| {model} | {recipe} | {figures['final_loss']:.4f} | {figures['final_gap']:+.2%} | "
                f"{figures['tail_mean_gap']:+.2%} | {figures['largest_step_gap']:.2%} |"
            )
        result["models"][model] = entry
    (out / "float8_curves.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
