"""Simulate one training step of a traced graph on a device model.

Execution model (the one NCCL + one CUDA compute stream give in eager PyTorch):

- One compute stream runs every non-collective node in graph order, each for
  ``cost_model.node_compute_time``. Issuing a collective costs the compute stream nothing.
- Each process group has one communication stream. A collective is issued when the compute
  stream reaches it in graph order and starts when it is issued, its group's stream is free
  (collectives of one group run one after the other, in issue order) and its inputs are
  ready; it lasts ``cost_model.collective_time``. Collectives of different groups overlap
  each other and compute freely (no bandwidth or SM contention is modelled).
- A ``wait_tensor`` blocks the compute stream until its collective has finished; the time
  the compute stream spends blocked there is *exposed* time, charged to what held it up: to each
  collective its group's stream ran meanwhile (a wait for a collective queued behind an earlier
  one of its group exposes the earlier one for as long as it still ran), and the rest (the
  stream idle, the collective's inputs not ready) to the collective waited for.

``step_time`` is when the last stream finishes, ``compute_time`` the sum of compute costs
(``compute_by_class`` splits it by ``cost_model.kernel_class``),
``comm_time`` the sum of collective durations and ``exposed_comm_time`` the sum of blocked
time (so ``step_time == compute_time + exposed_comm_time`` when every collective is waited).
``by_kind`` and ``sent_bytes`` total the bytes one rank sends per collective kind, split into
intra-node (NVLink) and inter-node (InfiniBand) links as ``cost_model.collective_traffic`` splits
each collective's.
The peak memory estimate is ``graph_trainer.analysis.memory.estimate_peak_memory``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch.fx as fx

from graph_trainer.analysis.cost_model import (
    GroupInfo,
    collective_traffic,
    group_info,
    kernel_class,
    node_compute_time,
    traffic_time,
)
from graph_trainer.analysis.devices import DeviceModel
from graph_trainer.analysis.fusion import FusionPlan, fuse_kernels
from graph_trainer.analysis.memory import MemoryEstimate, estimate_peak_memory
from graph_trainer.graph import collectives, tags
from graph_trainer.graph.collectives import collective_bytes, group_name, is_collective, is_wait, launch_of
from graph_trainer.graph.sizes import SizeHints

COMPUTE_TRACK = "compute"


@dataclass
class CollectiveRecord:
    """One simulated collective (seconds from the start of the step)."""

    name: str
    kind: str
    group: str
    group_size: int
    bytes: int
    issue: float
    start: float
    end: float
    exposed: float = 0.0
    """Seconds the compute stream was blocked while this collective ran (waiting for it, or for one
    queued behind it on its group's stream), or waiting for it while its stream sat idle."""
    module_fqn: str = ""
    bytes_sent: float = 0.0
    """Bytes this rank sends for it (``cost_model.collective_traffic``), not ``bytes``'s full buffer."""
    inter_node: bool = False
    """Whether any of ``bytes_sent`` leaves the node."""
    bytes_inter_node: float = 0.0
    """Of ``bytes_sent``, the bytes over this rank's inter-node NIC; the rest go over NVLink."""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class SimulationResult:
    device: str
    step_time: float
    compute_time: float
    comm_time: float
    exposed_comm_time: float
    collectives: list[CollectiveRecord]
    memory: MemoryEstimate
    """Peak memory estimate of the graph (same size hints as the timing)."""
    compute_events: list[tuple[str, float, float, str]] = field(default_factory=list, repr=False)
    """(node name, start, duration, module FQN) of every compute kernel, for the timeline."""
    wait_events: list[tuple[str, float, float]] = field(default_factory=list, repr=False)
    """(collective name, start, duration) of every stall of the compute stream."""
    compute_by_class: dict[str, float] = field(default_factory=dict)
    """Seconds of compute per kernel class (``cost_model.kernel_class``); sums to ``compute_time``."""

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_comm_time / self.step_time if self.step_time else 0.0

    @property
    def peak_memory_bytes(self) -> int:
        return self.memory.peak_bytes

    def by_kind(self) -> dict[str, dict[str, float]]:
        """Per collective kind present: count, bytes (full buffers), time and exposed time
        (seconds), and the bytes this rank sends over intra-node and inter-node links
        (``sent_intra_node``, ``sent_inter_node``)."""
        out: dict[str, dict[str, float]] = {}
        for c in self.collectives:
            row = out.setdefault(
                c.kind,
                {"count": 0, "bytes": 0, "time": 0.0, "exposed": 0.0, "sent_intra_node": 0.0, "sent_inter_node": 0.0},
            )
            row["count"] += 1
            row["bytes"] += c.bytes
            row["time"] += c.duration
            row["exposed"] += c.exposed
            row["sent_inter_node"] += c.bytes_inter_node
            row["sent_intra_node"] += c.bytes_sent - c.bytes_inter_node
        return out

    def sent_bytes(self, inter_node: bool) -> float:
        """Bytes this rank sends in the step over inter-node (True) or intra-node (False) links."""
        return sum(c.bytes_inter_node if inter_node else c.bytes_sent - c.bytes_inter_node for c in self.collectives)

    def to_chrome_trace(self, path: str) -> None:
        """Write a Chrome/Perfetto trace: a compute track and one track per process group."""
        sizes = {c.group: c.group_size for c in self.collectives}
        groups = sorted(sizes)
        tids = {COMPUTE_TRACK: 0, **{g: i + 1 for i, g in enumerate(groups)}}
        events: list[dict] = [
            {
                "ph": "M",
                "name": "process_name",
                "pid": 0,
                "tid": 0,
                "args": {"name": f"simulated step on {self.device}"},
            }
        ]
        for track, tid in tids.items():
            label = track if track == COMPUTE_TRACK else f"group {track} (size {sizes[track]})"
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": label}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid, "args": {"sort_index": tid}})

        def span(name, start, dur, tid, cat, **args):
            events.append(
                {
                    "ph": "X",
                    "name": name,
                    "cat": cat,
                    "pid": 0,
                    "tid": tid,
                    "ts": start * 1e6,
                    "dur": dur * 1e6,
                    "args": args,
                }
            )

        for name, start, dur, fqn in self.compute_events:
            span(name, start, dur, 0, "compute", module_fqn=fqn)
        for name, start, dur in self.wait_events:
            span(f"wait {name}", start, dur, 0, "exposed_comm")
        for c in self.collectives:
            span(
                c.name,
                c.start,
                c.duration,
                tids[c.group],
                c.kind,
                kind=c.kind,
                bytes=c.bytes,
                bytes_sent=c.bytes_sent,
                inter_node=c.inter_node,
                bytes_inter_node=c.bytes_inter_node,
                group_size=c.group_size,
                exposed_us=c.exposed * 1e6,
                module_fqn=c.module_fqn,
            )
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def simulate(
    graph: fx.Graph,
    device: DeviceModel,
    ranks_per_node: int = 8,
    group_sizes: dict[str, int] | None = None,
    record_events: bool = True,
    fused: bool = False,
    hints: SizeHints | None = None,
) -> SimulationResult:
    """Simulate ``graph`` on ``device`` (see the module docstring for the model).

    ``group_sizes`` overrides the size of process groups by name (for graphs built without a
    live process group); otherwise sizes come from the ops' arguments or the live groups.
    ``record_events`` keeps every compute kernel's span for ``to_chrome_trace``. ``fused`` costs the
    compute as Inductor would fuse it (``analysis.fusion``) instead of op by op. ``hints``: the
    data-dependent sizes (default ``SizeHints.from_graph(graph)``); a piece of a graph cut apart
    (a pipeline stage's backward) takes its whole graph's: the sizes it reads were made elsewhere.
    """
    if isinstance(graph, fx.GraphModule):
        graph = graph.graph
    hints = hints or SizeHints.from_graph(graph)
    plan = fuse_kernels(graph, hints) if fused else None
    step = _StepSimulation(device, hints, ranks_per_node, group_sizes or {}, record_events, plan)
    for node in graph.nodes:
        step.run(node)
    return step.result(estimate_peak_memory(graph, hints))


@dataclass
class _StepSimulation:
    """One step being simulated, node by node in graph order: the compute stream's clock, when each
    process group's communication stream is next free, when each node's output is ready, and the
    totals, records and events the ``SimulationResult`` reports."""

    device: DeviceModel
    hints: SizeHints
    ranks_per_node: int
    group_sizes: dict[str, int]
    """Process group sizes by name that override the ops' arguments and the live groups."""
    record_events: bool
    plan: FusionPlan | None = None
    """Inductor's kernels as ``analysis.fusion`` models them; None: op by op."""
    now: float = 0.0
    """The compute stream's clock."""
    compute_total: float = 0.0
    exposed_total: float = 0.0
    stream_free: dict[str, float] = field(default_factory=dict)
    """Per process group: when its communication stream has finished what was issued to it."""
    ready: dict[fx.Node, float] = field(default_factory=dict)
    """Per node: when its output is available to the nodes that read it."""
    launches: dict[fx.Node, CollectiveRecord] = field(default_factory=dict)
    """Per collective node: its record, which the wait on it reads."""
    infos: dict[str, GroupInfo] = field(default_factory=dict)
    records: list[CollectiveRecord] = field(default_factory=list)
    on_stream: dict[str, list[CollectiveRecord]] = field(default_factory=dict)
    """Per process group: its collectives' records in stream order."""
    compute_events: list[tuple[str, float, float, str]] = field(default_factory=list)
    wait_events: list[tuple[str, float, float]] = field(default_factory=list)
    by_class: dict[str, float] = field(default_factory=dict)

    def run(self, node: fx.Node) -> None:
        """Advance the streams by ``node``: a wait blocks the compute stream until its collective
        ends, a collective is queued on its group's stream, any other node runs on the compute stream."""
        inputs_ready = max((self.ready.get(a, 0.0) for a in node.all_input_nodes), default=0.0)
        if is_wait(node):
            self.ready[node] = self._wait(node)
        elif is_collective(node):
            self.ready[node] = self._issue_collective(node, inputs_ready)
        else:
            self.ready[node] = self._compute(node, inputs_ready)

    def _wait(self, node: fx.Node) -> float:
        """Block the compute stream until the collective ``node`` waits for has ended; the blocked
        time is exposed time, charged as ``_holdups`` splits it. Returns when the wait's output is ready."""
        record = self.launches.get(launch_of(node))
        if record is not None and record.end > self.now:
            self.exposed_total += record.end - self.now
            for holder, start, seconds in self._holdups(record):
                holder.exposed += seconds
                self.wait_events.append((holder.name, start, seconds))
            self.now = record.end
        return self.now

    def _holdups(self, record: CollectiveRecord) -> list[tuple[CollectiveRecord, float, float]]:
        """(collective, start, seconds) pieces of the compute stream's wait from now until ``record``
        ends: each collective of ``record``'s group for the part of the wait its run covers
        (``record`` itself among them), ``record`` for any part its stream was idle."""
        running = []
        for other in reversed(self.on_stream[record.group]):  # stream order: the latest first
            if other.end <= self.now:
                break
            if other.start < record.end:
                running.append(other)
        pieces, t = [], self.now
        for other in reversed(running):
            start, end = max(t, other.start), min(record.end, other.end)
            if start > t:
                pieces.append((record, t, start - t))
            if end > start:
                pieces.append((other, start, end - start))
                t = end
        if t < record.end:
            pieces.append((record, t, record.end - t))
        return pieces

    def _group(self, node: fx.Node) -> tuple[str, GroupInfo]:
        """The collective's process group: its name and (resolved once per group) its size and span."""
        group = group_name(node)
        if group not in self.infos:
            self.infos[group] = group_info(node, self.ranks_per_node, self.group_sizes.get(group))
        return group, self.infos[group]

    def _issue_collective(self, node: fx.Node, inputs_ready: float) -> float:
        """Issue the collective ``node`` at the compute stream's clock (costing it nothing) on its
        group's stream: it starts once issued, its inputs are ready and the stream is free, and
        holds the stream for its transfer time. Returns when it ends."""
        group, info = self._group(node)
        start = max(self.now, self.stream_free.get(group, 0.0), inputs_ready)
        traffic = collective_traffic(node, hints=self.hints, group=info)
        end = start + traffic_time(traffic, self.device)
        self.stream_free[group] = end
        record = CollectiveRecord(
            name=node.name,
            kind=collectives.kind(node),
            group=group,
            group_size=info.size,
            bytes=collective_bytes(node, self.hints),
            issue=self.now,
            start=start,
            end=end,
            module_fqn=tags.module_fqn(node),
            bytes_sent=traffic.bytes_sent,
            inter_node=traffic.inter_node,
            bytes_inter_node=traffic.bytes_inter_node,
        )
        self.launches[node] = record
        self.records.append(record)
        self.on_stream.setdefault(group, []).append(record)
        return end

    def _compute(self, node: fx.Node, inputs_ready: float) -> float:
        """Run ``node`` on the compute stream once its inputs are ready, for its compute cost (nodes
        that cost nothing, such as views, do not wait). Returns when its output is ready."""
        cost, cls = self._cost(node)
        if cost > 0:
            self.now = max(self.now, inputs_ready)
            if self.record_events:
                self.compute_events.append((node.name, self.now, cost, tags.module_fqn(node)))
            self.now += cost
            self.compute_total += cost
            self.by_class[cls] = self.by_class.get(cls, 0.0) + cost
        return max(self.now, inputs_ready)

    def _cost(self, node: fx.Node) -> tuple[float, str]:
        """(seconds, class) of ``node`` on the compute stream: op by op, or as ``plan`` fuses it (a
        fused kernel's whole cost at its last node, its class prefixed ``fused``)."""
        fused = self.plan.cost(node, self.device) if self.plan is not None else None
        if fused is not None:
            return fused
        return node_compute_time(node, self.device, self.hints), kernel_class(node, self.hints)

    def result(self, memory: MemoryEstimate) -> SimulationResult:
        """The step as simulated so far: it ends when the last stream finishes."""
        return SimulationResult(
            device=self.device.name,
            step_time=max([self.now, *(r.end for r in self.records)]),
            compute_time=self.compute_total,
            comm_time=sum(r.duration for r in self.records),
            exposed_comm_time=self.exposed_total,
            collectives=self.records,
            memory=memory,
            compute_events=self.compute_events,
            wait_events=self.wait_events,
            compute_by_class=self.by_class,
        )


def format_table(rows: list[dict[str, object]]) -> str:
    """Rows of dicts (the first row's keys are the columns) as an aligned text table."""
    if not rows:
        return ""
    columns = list(rows[0])
    cells = [[str(c) for c in columns]] + [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = [
        "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True)))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


__all__ = ["CollectiveRecord", "SimulationResult", "format_table", "simulate"]
