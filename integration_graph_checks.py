"""What the h100 dry run (``integration_tests.py --dry-run``, ``integration_dry_run.dry_run``) checks
in a traced graph after its passes: ``check_graph`` for a whole step (the collectives its layout
needs, their tags, transformer-block bucket counts, what each pass must leave), ``check_stage_graph``
for one pipeline stage's graph, ``check_backend`` for the Inductor regions cut out of it.

Each returns a list of problems (empty when the graph is right); none changes the graph it is
given except ``check_backend``, which cuts the case's own copy."""

from __future__ import annotations

from collections import Counter

from graph_trainer.graph import tags
from graph_trainer.graph.tags import (
    BACKWARD,
    COMBINE,
    COUNT_EXCHANGE,
    DISPATCH,
    EP_ROLE,
    FORWARD,
    FSDP_BUCKET,
    FSDP_PARAM,
    FSDP_ROLE,
    MOE_FQN,
    PHASE,
    REDUCE_GRAD,
)
from suites import BUCKETING

FSDP_GATHER = ("all_gather_into_tensor", "all_gather_into_tensor_out")
COLLECTIVE_KINDS = {
    "AG": FSDP_GATHER,
    "RS": ("reduce_scatter_tensor",),
    "AR": ("all_reduce",),
    "A2A": ("all_to_all_single",),
}
"""The collectives the checks count, by the short name the dry run's table shows them under."""


def collective_launches(gm) -> list:
    """The collective launches of ``gm``, in graph order."""
    from graph_trainer.graph.collectives import is_collective

    return [n for n in gm.graph.nodes if is_collective(n)]


def fsdp_launches(nodes, op: tuple[str, ...], phase: str) -> list:
    """The FSDP collectives (tagged ``fsdp_role``) among ``nodes`` named in ``op``, of ``phase``."""
    from graph_trainer.graph.collectives import collective_name

    return [n for n in nodes if collective_name(n) in op and tags.get(n, FSDP_ROLE) and tags.get(n, PHASE) == phase]


def _data_parallel_problems(nodes, degrees: dict[str, int]) -> list[str]:
    """FSDP all-gathers and reduce-scatters (tagged ``fsdp_role``) iff ``dp_shard > 1``; gradient
    all-reduces (tagged ``reduce_grad``) iff ``dp_replicate > 1``."""
    problems = []
    gathers = fsdp_launches(nodes, FSDP_GATHER, "forward")
    reduces = fsdp_launches(nodes, ("reduce_scatter_tensor",), "backward")
    if bool(gathers and reduces) != (degrees["dp_shard"] > 1):
        problems.append(
            f"dp_shard={degrees['dp_shard']} but {len(gathers)} FSDP all-gathers, {len(reduces)} reduce-scatters"
        )
    all_reduces = [
        n for n in fsdp_launches(nodes, COLLECTIVE_KINDS["AR"], "backward") if tags.get(n, FSDP_ROLE) == REDUCE_GRAD
    ]
    if bool(all_reduces) != (degrees["dp_replicate"] > 1):
        problems.append(
            f"dp_replicate={degrees['dp_replicate']} but {len(all_reduces)} gradient all-reduces (reduce_grad)"
        )
    return problems


def check_graph(gm, reference, cfg, degrees: dict[str, int], plan: list[list[str]]) -> list[str]:
    """What is wrong with a traced (and passed) graph; ``reference`` is its layout's graph after the
    default passes only. Checks, from the config and the model's flavor:

    * the collectives of each parallel dim: FSDP all-gathers and reduce-scatters (tagged
      ``fsdp_role``) iff ``dp_shard > 1``; gradient all-reduces (tagged ``reduce_grad``) iff
      ``dp_replicate > 1``, each of a reduce-scattered parameter summing its shard (HSDP's order),
      untagged ones if ``tp > 1``, none on LLaMA-3 without either; all_to_alls iff ``ep > 1``, each tagged
      ``ep_role`` (count_exchange / dispatch / combine) and ``moe_fqn``, every MoE layer with its
      forward dispatch and combine and their backward;
    * ``transformer_block_bucketing``: n_layers + 2 forward all-gather buckets (embeddings, each
      block, norm + output), n_layers + 1 backward re-gather buckets (the embedding's backward does
      not read its weight; none if parameters are kept), n_layers + 2 reduce-scatter buckets
      (with ``dp_shard > 1``) and n_layers + 2 gradient all-reduce buckets (with
      ``dp_replicate > 1``), one collective per bucket and process group, other collectives as
      in ``reference``; followed by
      ``auto_bucketing``: every FSDP collective still in a block bucket, no more of them;
    * ``auto_bucketing`` alone: fewer FSDP collectives than ``reference``, the same all_to_alls;
    * ``ep_overlap``: the forward and the backward of one chunked module per MoE layer and, unless
      ``reorder`` is off, the schedule ``ep_overlap.verify_schedule`` checks (after every pass).
    """
    from models.registry import model_args

    args = model_args(cfg)
    nodes, ref_nodes = collective_launches(gm), collective_launches(reference)
    passes = list(cfg.compile.passes)
    n = args.n_layers
    return [
        *_data_parallel_problems(nodes, degrees),
        *_hsdp_order_problems(ref_nodes),
        *_tensor_parallel_problems(nodes, cfg, degrees),
        *_all_to_all_problems(nodes, args, degrees),
        *_problem(
            len(plan) == n + 2, f"the model's bucket plan has {len(plan)} groups, expected n_layers + 2 = {n + 2}"
        ),
        *_block_bucket_problems(nodes, ref_nodes, passes, _expected_block_buckets(cfg, degrees, n), plan),
        *_non_fsdp_collective_problems(nodes, ref_nodes, passes),
        *_ep_overlap_problems(gm, cfg, args, passes),
        *_auto_bucketing_problems(nodes, ref_nodes, passes, degrees),
    ]


def _problem(ok: bool, message: str) -> list[str]:
    """``[message]`` where a check fails, nothing where it holds."""
    return [] if ok else [message]


def _of_kind(nodes, kind: str) -> list:
    """The collectives among ``nodes`` of one ``COLLECTIVE_KINDS`` kind ("AG", "RS", "AR", "A2A")."""
    from graph_trainer.graph.collectives import collective_name

    return [n for n in nodes if collective_name(n) in COLLECTIVE_KINDS[kind]]


def _hsdp_order_problems(ref_nodes) -> list[str]:
    """HSDP reduce-scatters a gradient before all-reducing its shard (``_full_gradient_all_reduces``),
    checked on the reference graph: the order comes from the layout, not from a pass."""
    full = _full_gradient_all_reduces(ref_nodes)
    return _problem(not full, f"HSDP all-reduces before reduce-scattering: {full[:3]}")


def _tensor_parallel_problems(nodes, cfg, degrees: dict[str, int]) -> list[str]:
    """On LLaMA-3: with ``tp > 1``, all-reduces not tagged ``fsdp_role`` (tensor parallel's); and
    all-reduces at all iff ``tp > 1`` or ``dp_replicate > 1``."""
    if cfg.model.name != "llama3":
        return []
    all_reduces = _of_kind(nodes, "AR")
    tp_reduce = [n for n in all_reduces if not tags.get(n, FSDP_ROLE)]
    tp, replicate = degrees["tp"], degrees["dp_replicate"]
    return [
        *_problem(bool(tp_reduce) or tp == 1, f"tp={tp} but no TP all-reduce"),
        *_problem(
            bool(all_reduces) == (tp > 1 or replicate > 1),
            f"{len(all_reduces)} all-reduces with tp={tp}, dp_replicate={replicate}",
        ),
    ]


def _all_to_all_problems(nodes, args, degrees: dict[str, int]) -> list[str]:
    """all_to_alls iff ``ep > 1``, each tagged ``ep_role`` (count_exchange / dispatch / combine) and
    ``moe_fqn``; every MoE layer of the model with its forward dispatch and combine and their backward."""
    a2a = _of_kind(nodes, "A2A")
    ep = degrees.get("ep", 1)
    problems = _problem(bool(a2a) == (ep > 1), f"ep={ep} but {len(a2a)} all_to_alls")
    untagged = [
        n.name
        for n in a2a
        if tags.get(n, EP_ROLE) not in (COUNT_EXCHANGE, DISPATCH, COMBINE) or not tags.get(n, MOE_FQN)
    ]
    problems += _problem(not untagged, f"all_to_alls without ep_role / moe_fqn: {untagged[:3]}")
    if not a2a:
        return problems
    roles = Counter((tags.get(n, MOE_FQN), tags.get(n, PHASE), tags.get(n, EP_ROLE)) for n in a2a)
    n_moe = args.n_layers - args.n_dense_layers
    layers = {fqn for fqn, _, _ in roles}
    problems += _problem(len(layers) == n_moe, f"all_to_alls in {len(layers)} MoE layers, the model has {n_moe}")
    missing = [
        (fqn, phase, role)
        for fqn in layers
        for phase in (FORWARD, BACKWARD)
        for role in (DISPATCH, COMBINE)
        if not roles[(fqn, phase, role)]
    ]
    return problems + _problem(not missing, f"MoE layers without an all_to_all for {missing[:3]}")


def _expected_block_buckets(cfg, degrees: dict[str, int], n: int) -> dict[tuple[str, str], int]:
    """How many buckets ``transformer_block_bucketing`` makes of the FSDP collectives, per (kind,
    phase), for a model of ``n`` blocks: all-gathers n + 2 forward (embeddings, each block, norm +
    output) and in the backward n + 1 (``fsdp_reshard_after_forward`` always), n (default: norm and
    output kept) or none (never), reduce-scatters n + 2 (with ``dp_shard > 1``); gradient
    all-reduces n + 2 (with ``dp_replicate > 1``)."""
    regathered = {"always": n + 1, "default": n, "never": 0}[cfg.parallelism.fsdp_reshard_after_forward]
    expected = {}
    if degrees["dp_shard"] > 1:
        expected = {("AG", "forward"): n + 2, ("AG", "backward"): regathered, ("RS", "backward"): n + 2}
    if degrees["dp_replicate"] > 1:
        expected[("AR", "backward")] = n + 2
    return expected


def _block_bucket_problems(nodes, ref_nodes, passes: list[str], expected: dict, plan: list[list[str]]) -> list[str]:
    """With ``transformer_block_bucketing``: every FSDP collective of each ``expected`` (kind, phase)
    in a block bucket (tagged ``fsdp_bucket``) and, alone, the expected number of buckets and one
    collective per (bucket, process group) that the reference's per-parameter collectives span;
    followed by ``auto_bucketing``, no more collectives than those pairs. (``auto_bucketing`` alone
    buckets by its own rule: ``_auto_bucketing_problems``.)"""
    from graph_trainer.compiler.passes.transformer_block_bucketing import bucket_index
    from graph_trainer.graph.collectives import group_name

    if not set(passes) & {BUCKETING["tbb"], BUCKETING["auto"]}:  # (the passes one by one)
        return []
    problems = []
    for (kind, phase), buckets in expected.items():
        got, ref = (
            fsdp_launches(nodes, COLLECTIVE_KINDS[kind], phase),
            fsdp_launches(ref_nodes, COLLECTIVE_KINDS[kind], phase),
        )
        # one collective per (bucket, process group) that the reference's per-parameter collectives span
        ref_pairs = {(bucket_index(plan, tags.get(r, FSDP_PARAM)), group_name(r)) for r in ref}
        if "auto_bucketing" in passes and "transformer_block_bucketing" not in passes:
            continue
        unbucketed = [r.name for r in got if not tags.has(r, FSDP_BUCKET)]
        problems += _problem(not unbucketed, f"{phase} FSDP {kind} outside a block bucket: {unbucketed[:3]}")
        if "auto_bucketing" in passes:
            problems += _problem(
                len(got) <= len(ref_pairs), f"{phase} {kind}: {len(got)} > {len(ref_pairs)} block buckets"
            )
            continue
        names = {tags.get(r, FSDP_BUCKET) for r in got}
        problems += _problem(len(names) == buckets, f"{phase} {kind}: {len(names)} buckets, expected {buckets}")
        problems += _problem(
            len(got) == len(ref_pairs),
            f"{phase} {kind}: {len(got)} collectives for {len(ref_pairs)} (bucket, group) pairs",
        )
    return problems


def _non_fsdp_collective_problems(nodes, ref_nodes, passes: list[str]) -> list[str]:
    """``transformer_block_bucketing`` alone leaves the collectives not tagged ``fsdp_role`` (tensor
    and expert parallel's) as the reference has them: the same ops, as many, in each phase."""
    from graph_trainer.graph.collectives import collective_name

    if passes != [BUCKETING["tbb"]]:
        return []
    others = Counter((collective_name(x), tags.get(x, PHASE)) for x in nodes if not tags.get(x, FSDP_ROLE))
    ref_others = Counter((collective_name(x), tags.get(x, PHASE)) for x in ref_nodes if not tags.get(x, FSDP_ROLE))
    return _problem(others == ref_others, f"non-FSDP collectives changed: {dict(others)} vs {dict(ref_others)}")


def _ep_overlap_problems(gm, cfg, args, passes: list[str]) -> list[str]:
    """``ep_overlap``: the forward and the backward of one chunked module per MoE layer and, unless ``reorder``
    is off, the schedule ``ep_overlap.verify_schedule`` checks (after every pass)."""
    from graph_trainer.compiler.passes.ep_overlap import find_chunked_modules, verify_schedule

    if "ep_overlap" not in passes:
        return []
    chunked = find_chunked_modules(gm.graph)
    n_moe = args.n_layers - args.n_dense_layers
    problems = _problem(
        len(chunked) == 2 * n_moe,
        f"ep_overlap: {len(chunked)} chunked modules (per phase), expected forward and backward of {n_moe} MoE layers",
    )
    if cfg.compile.ep_overlap.reorder:
        wrong = verify_schedule(gm.graph)
        problems += _problem(not wrong, f"ep_overlap schedule broken in {len(wrong)} places: {wrong[:1]}")
    return problems


def _auto_bucketing_problems(nodes, ref_nodes, passes: list[str], degrees: dict[str, int]) -> list[str]:
    """``auto_bucketing``: the all_to_alls as many as in the reference and, with ``dp_shard > 1``,
    fewer FSDP collectives than it."""
    if "auto_bucketing" not in passes:
        return []
    fsdp, ref_fsdp = (sum(bool(tags.get(x, FSDP_ROLE)) for x in ns) for ns in (nodes, ref_nodes))
    return [
        *_problem(
            len(_of_kind(nodes, "A2A")) == len(_of_kind(ref_nodes, "A2A")), "auto_bucketing changed the all_to_alls"
        ),
        *_problem(
            degrees["dp_shard"] == 1 or fsdp < ref_fsdp,
            f"auto_bucketing: {fsdp} FSDP collectives, not fewer than {ref_fsdp} without passes",
        ),
    ]


def _full_gradient_all_reduces(nodes) -> list[str]:
    """Gradient all-reduces of a parameter that is also reduce-scattered, whose element count is
    not the reduce-scatter's output (HSDP must all-reduce the shard, after the reduce-scatter)."""
    from graph_trainer.graph.collectives import collective_name

    shard = {
        tags.get(n, FSDP_PARAM): n.meta["val"].numel()
        for n in nodes
        if collective_name(n) in COLLECTIVE_KINDS["RS"] and tags.get(n, FSDP_ROLE)
    }
    return [
        n.name
        for n in nodes
        if collective_name(n) in COLLECTIVE_KINDS["AR"]
        and tags.get(n, FSDP_ROLE) == REDUCE_GRAD
        and tags.get(n, FSDP_PARAM) in shard
        and n.meta["val"].numel() != shard[tags.get(n, FSDP_PARAM)]
    ]


def check_backend(gm, cfg, row: dict[str, object]) -> list[str]:
    """With ``--compile.backend inductor`` (regional): cut ``gm`` (in place) into its compiled regions
    (``graph_trainer.compiler.backend.cut_regions``, nothing is compiled: that needs the GPU) and check that
    no region holds a collective and the collectives keep their order. Sets ``row["regions"]``: how many
    ("full": one graph, whose order only Inductor on a GPU decides)."""
    from graph_trainer.compiler.backend import cut_regions
    from graph_trainer.graph.collectives import collective_name, collective_order

    c = cfg.compile
    if c.backend == "none":
        return []
    if c.inductor_scope == "full":
        row["regions"] = "full"  # one Inductor graph: its order is Inductor's, measured on a GPU
        return []
    order = collective_order(gm.graph)
    cut, names = cut_regions(gm)  # in place: the case's own copy, not used after this
    row["regions"] = str(len(names))
    problems = []
    if collective_order(cut.graph) != order:
        problems.append("cutting the Inductor regions changed the collective order")
    inside = [n for name in names for n in getattr(cut, name).graph.nodes if collective_name(n) is not None]
    if inside:
        problems.append(f"{len(inside)} collectives inside compiled regions")
    return problems


def check_stage_graph(
    gm, cfg, degrees: dict[str, int], blocks: range, first: bool, last: bool, resident=None
) -> list[str]:
    """What is wrong with one pipeline stage's graph (after its passes): FSDP all-gathers and
    reduce-scatters iff ``dp_shard > 1``, gradient all-reduces iff ``dp_replicate > 1`` (with weights
    resident per step, ``resident`` its ``ResidentTrace``: in its gather and reduce graphs, none in
    the microbatch's graph ``gm``); on LLaMA-3,
    tensor parallel's all-reduces iff ``tp > 1`` (every stage holds blocks);
    all_to_alls iff ``ep > 1`` and the stage holds MoE blocks, each tagged, every MoE block of the
    stage with its dispatch and combine both ways and nothing of another stage's; with
    ``transformer_block_bucketing`` alone, one forward all-gather bucket per block plus the
    embedding's (first stage) and the norm and output's (last); with ``ep_overlap``, a forward
    and a backward chunked module per MoE block of the stage."""
    from graph_trainer.compiler.passes.ep_overlap import find_chunked_modules
    from graph_trainer.graph.collectives import collective_name
    from models.registry import model_args

    args = model_args(cfg)
    nodes, problems = collective_launches(gm), []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    fsdp_nodes = nodes
    if resident is not None:
        in_step = [n for n in nodes if tags.has(n, FSDP_ROLE)]
        need(not in_step, f"{len(in_step)} SimpleFSDP collectives in the microbatch graph of weights resident per step")
        fsdp_nodes = collective_launches(resident.gather) + collective_launches(resident.reduce)
    problems += _data_parallel_problems(fsdp_nodes, degrees) + _tensor_parallel_problems(nodes, cfg, degrees)
    gathers = fsdp_launches(fsdp_nodes, FSDP_GATHER, "forward")
    n_dense = getattr(args, "n_dense_layers", None)  # (None: a model without MoE blocks)
    moe = [] if n_dense is None else [b for b in blocks if b >= n_dense]
    a2a = [n for n in nodes if collective_name(n) in COLLECTIVE_KINDS["A2A"]]
    need(bool(a2a) == (degrees.get("ep", 1) > 1 and bool(moe)), f"ep={degrees.get('ep', 1)}: {len(a2a)} all_to_alls")
    roles = Counter((tags.get(n, MOE_FQN), tags.get(n, PHASE), tags.get(n, EP_ROLE)) for n in a2a)
    layers = {fqn for fqn, _, _ in roles}
    expected_layers = {f"layers.{b}.moe" for b in moe} if a2a else set()
    need(layers == expected_layers, f"all_to_alls in MoE layers {sorted(layers)[:3]}, the stage holds {len(moe)}")
    missing = [
        key
        for fqn in layers
        for key in ((fqn, p, r) for p in (FORWARD, BACKWARD) for r in (DISPATCH, COMBINE))
        if not roles[key]
    ]
    need(not missing, f"MoE layers without an all_to_all for {missing[:3]}")
    passes = list(cfg.compile.passes)
    if passes == [BUCKETING["tbb"]] and degrees["dp_shard"] > 1:
        buckets = {tags.get(n, FSDP_BUCKET) for n in gathers}
        want = len(blocks) + first + last
        unbucketed = [n.name for n in gathers if not tags.has(n, FSDP_BUCKET)]
        need(len(buckets) == want and not unbucketed, f"forward all-gathers in {len(buckets)} buckets, expected {want}")
    if "ep_overlap" in passes:
        chunked = find_chunked_modules(gm.graph)
        need(
            len(chunked) == 2 * len(moe),
            f"ep_overlap: {len(chunked)} chunked modules (per phase) for {len(moe)} MoE blocks",
        )
    return problems
