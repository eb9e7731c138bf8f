"""graph_trainer: trace a whole training step into one aten FX graph and train with it.

The folders follow the flow config -> build -> trace -> compile chain -> run, with checkpoints,
data and metrics beside the loop (docs/architecture.md draws the layers):

- ``errors``, ``torch_compat/``, ``graph/``, ``config``, ``config_loading``: the ground floor;
- ``loss``: the loss head the models call;
- ``distributed/``: degrees and mesh, SimpleFSDP, expert parallel, chunking, collective timeouts;
- ``analysis/``: estimates of a graph (cost model, memory, simulator);
- ``compiler/``: the tracer and the compile chain (memory policy, passes, backend);
- ``pipelining/``: pipeline parallel over traced stage graphs;
- ``build``, ``fake_trace``, ``validation``: a job built, traced on one CPU, checked;
- ``loop/``, ``data/``, ``checkpoint/``, ``trainer``: the training loop and what it uses;
- ``cli/``: the commands (``python -m graph_trainer.cli.<name>``).
"""
