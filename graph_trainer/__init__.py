"""graph_trainer: trace a whole training step into one aten FX graph and train with it.

The package is organised by concern: ``config`` (job configuration), ``tracer``
(make_fx capture of forward + loss + backward), ``passes`` (graph passes),
``trainer`` (the training loop), ``data``, ``metrics``, ``optim``.
"""
