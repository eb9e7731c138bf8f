"""Graph facts: the ground floor every stage reads a traced node's meaning through.

- ``tags``: every node-metadata key and value (phase, module, FSDP and EP roles, chunks,
  memory-policy decisions, compiled regions), with who writes and who reads each;
- ``collectives``: which nodes communicate, their kind, group and bytes, launch -> wait pairing;
- ``ops``: named op sets (matmuls, attention, views, size reads) and op arguments;
- ``sizes``: concrete sizes of values whose shapes hold data-dependent symbols.

Nothing here imports another graph_trainer layer except ``errors`` and ``torch_compat``.
"""
