"""Long context under context parallel, simulated: Llama3-8B on 8 GPUs at 32K to 256K tokens and
Llama3-405B at 128K tokens on 512 GPUs, one ``analyze`` per traced rank.

    .venv/bin/python -m benchmarks.long_context [--rows NAME,...] [--cp_ranks all|first]
        [--n_layers N] [--json OUT.json]

Every row is one job of ``graph_trainer.cli.analyze`` (called in this process, reading the ``--json``
it writes; each call's command is printed so it can be run alone): sequences of ``seq_len`` tokens cut
over ``cp`` context-parallel ranks (``models.sequence``: two chunks a rank, keys and values gathered
over cp, each chunk attended with an additive mask by the memory-efficient kernel), SimpleFSDP over
dp_shard x cp (the ``transformer_block_bucketing`` pass), full activation checkpointing, one sequence
per data-parallel rank, FP8 linears (torchao's tensorwise recipe), bf16 compute with fp32 gradient
reduction, the loss in ``LOSS_CHUNKS`` pieces; the 405B row adds tensor parallel 8 inside a node
with sequence parallel. Simulated on ``DEVICE`` (torchtitan's benchmark H100: 500 W, HBM2e) with
``ATTENTION`` (FlashAttention-2) rates: the masked memory-efficient kernel has no measured or
published rate here and runs at FA2's causal rates, a rate that flatters it.

The model is its flavor with ``--model.max_seq_len`` positions: Llama 3.1's published context,
``CONTEXT`` (131,072; the project's flavors keep their pre-training 8,192), and for the 256K rows
their length (no published checkpoint has a rotary table that long).

Per row the script traces every context-parallel rank (``--cp_ranks all``; ``first``: cp rank 0
only), at data-parallel and tensor-parallel coordinate 0: cp ranks hold different chunks (different
mask and key shapes), the other coordinates the same shapes (rank 0 the largest FSDP shard). It
prints the simulated step (the slowest traced rank's), tokens/s/GPU (the global batch's tokens over
that step, per GPU of the world), exposed communication, and the peak memory of every traced rank
against ``MEMORY_LIMIT_GIB``: an H100's 79.1 GiB usable (``analysis.memory``), below the 96 GB of
the simulated card. Every figure is simulated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass

from benchmarks.row_tables import chosen_rows, write_json
from graph_trainer.analysis.memory import DEVICE_MEMORY_BYTES
from graph_trainer.analysis.simulator import format_table
from graph_trainer.cli import analyze

DEVICE = "h100_hbm2e_500w"
"""torchtitan's benchmark H100 (``analysis.devices.H100_HBM2E_500W``), as in benchmarks/vs_torchtitan_h100.py."""
ATTENTION = "fa2"
"""FlashAttention-2's rates, as the comparison with torchtitan's published runs uses."""
MEMORY_LIMIT_GIB = DEVICE_MEMORY_BYTES["h100"] / (1 << 30)
"""The peak a rank must stay within: an 80 GB H100's usable memory (the simulated card has 96 GB)."""
CONTEXT = 131072
"""Llama 3.1's context (``max_position_embeddings`` of its published configs, torchtitan's flavors)."""
LOSS_CHUNKS = 8
"""The loss and output projection in 8 pieces of a rank's tokens (the project's 8B config)."""
_COMMON = (
    "--model.name llama3 --training.local_batch_size 1 --training.mixed_precision_param bfloat16 "
    "--training.mixed_precision_reduce float32 --activation_checkpoint.mode full --float8.recipe_name tensorwise "
    f"--compile.passes transformer_block_bucketing --compile.backend inductor --training.loss_chunks {LOSS_CHUNKS}"
).split()


@dataclass(frozen=True)
class Row:
    """One simulated job: a flavor at a sequence length on a layout."""

    name: str
    flavor: str
    world_size: int
    seq_len: int
    cp: int
    tp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks (``dp_shard``): one sequence each per step."""
        return self.world_size // (self.cp * self.tp)

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.dp

    def layout(self) -> str:
        tp = f" x TP {self.tp} (sequence parallel)" if self.tp > 1 else ""
        return f"FSDP {self.dp} x CP {self.cp}{tp}"

    def argv(self, n_layers: int = 0) -> list[str]:
        """``analyze``'s flags for this row (``n_layers``: blocks, 0 for the flavor's)."""
        tp = ["--parallelism.tp", str(self.tp), "--parallelism.sequence_parallel", "True"] if self.tp > 1 else []
        layers = ["--model.n_layers", str(n_layers)] if n_layers else []
        return [
            *("--world_size", str(self.world_size), "--device", DEVICE, "--attention", ATTENTION),
            *("--device_memory_gib", f"{MEMORY_LIMIT_GIB:.1f}", *_COMMON),
            *("--model.flavor", self.flavor, "--model.max_seq_len", str(max(CONTEXT, self.seq_len))),
            *("--training.seq_len", str(self.seq_len), "--parallelism.cp", str(self.cp)),
            *("--parallelism.dp_shard", str(self.dp), *tp, *layers),
        ]

    def cp_ranks(self, which: str) -> list[int]:
        """Global ranks of the cp ranks traced (dp and tp coordinates 0; the mesh is dp_shard x cp x tp)."""
        return [i * self.tp for i in range(self.cp if which == "all" else 1)]


def _rows(flavor: str, world: int, seq: int, cps: tuple[int, ...], tp: int = 1) -> list[Row]:
    return [Row(f"{flavor}-{seq // 1024}k-cp{cp}", flavor, world, seq, cp, tp) for cp in cps]


ROWS: tuple[Row, ...] = (
    *_rows("8B", 8, 32768, (2, 4, 8)),
    *_rows("8B", 8, 65536, (2, 4, 8)),
    *_rows("8B", 8, 131072, (2, 4, 8)),
    *_rows("8B", 8, 262144, (4, 8)),
    *_rows("405B", 512, 131072, (4, 8), tp=8),
)
"""Per model and sequence length, the FSDP x CP splits of its GPUs compared (``best`` marks the
fastest that fits)."""
CHEAPEST = "8B-32k-cp2"


def mark_best(table: list[dict[str, object]]) -> None:
    """Set each printed row's "best": whether it is the fastest of the rows of its model and sequence
    length whose peak fits (``MEMORY_LIMIT_GIB``)."""
    for row in table:
        rivals = [r for r in table if (r["model"], r["seq"]) == (row["model"], row["seq"]) and r["fits"]]
        row["best"] = bool(row["fits"]) and row["tokens/s/GPU"] == max(r["tokens/s/GPU"] for r in rivals)


def analyze_rank(argv: list[str], rank: int) -> dict:
    """``analyze``'s summary row of the job ``argv`` traced as global ``rank``; RuntimeError if refused."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "rank.json")
        command = [*argv, "--rank", str(rank), "--json", path]
        print("# .venv/bin/python -m graph_trainer.cli.analyze " + " ".join(command[:-2]), flush=True)
        code = analyze.main(command)
        if code != 0:
            raise RuntimeError(f"analyze refused the job (exit {code}): {' '.join(command)}")
        with open(path, encoding="utf-8") as f:
            return json.load(f)["summary"][0]


def simulate_row(row: Row, cp_ranks: str = "all", n_layers: int = 0) -> dict[str, object]:
    """The printed row: ``analyze`` of each traced cp rank, combined (module docstring)."""
    argv = row.argv(n_layers)
    ranks = row.cp_ranks(cp_ranks)
    summaries = {rank: analyze_rank(argv, rank) for rank in ranks}
    slowest = max(ranks, key=lambda r: summaries[r]["step ms"])
    highest = max(ranks, key=lambda r: summaries[r]["peak GiB"])
    step_ms = summaries[slowest]["step ms"]
    peaks = [summaries[r]["peak GiB"] for r in ranks]
    return {
        "row": row.name,
        "model": f"Llama3-{row.flavor}",
        "layout": row.layout(),
        "seq": row.seq_len,
        "GPUs": row.world_size,
        "tokens/step": row.tokens_per_step,
        "step ms": step_ms,
        "tokens/s/GPU": row.tokens_per_step / (step_ms / 1e3) / row.world_size,
        "exposed ms": summaries[slowest]["exposed ms"],
        "exposed %": summaries[slowest]["exposed %"],
        "ranks traced": len(ranks),
        "peak GiB": peaks[ranks.index(highest)],
        "at rank": highest,
        "lowest peak GiB": min(peaks),
        "activ GiB": summaries[highest]["activ GiB"],
        "limit GiB": MEMORY_LIMIT_GIB,
        "fits": max(peaks) <= MEMORY_LIMIT_GIB,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = ", ".join(r.name for r in ROWS)
    parser.add_argument("--rows", default="", help=f"comma-separated row names (default: all): {names}")
    parser.add_argument("--cp_ranks", default="all", choices=("all", "first"), help="cp ranks traced per row")
    parser.add_argument("--n_layers", type=int, default=0, help="blocks per model (0: the flavor's; fewer: a check)")
    parser.add_argument("--json", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    rows = chosen_rows(args.rows, ROWS)
    if rows is None:
        return 2
    if args.n_layers < 0:
        print(f"error: --n_layers {args.n_layers} must be >= 0 (0: the flavor's)", file=sys.stderr)
        return 2
    table = [simulate_row(row, args.cp_ranks, args.n_layers) for row in rows]
    mark_best(table)
    print()
    print(f"simulated on {DEVICE} with {ATTENTION} attention rates; peak limit {MEMORY_LIMIT_GIB:.1f} GiB")
    print(format_table(table))
    write_json(args.json, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
