"""Pipeline parallel: the callables a pipeline schedule runs, cut from each stage's traced graph."""
