"""LLaMA-3: ``flavors`` (arguments, sizes, FLOPs per token), ``model`` (the transformer) and
``parallelize`` (its TP + SimpleFSDP plan). Import from those modules: this package's own module
imports nothing, so that the model layer and the parallel layer stay apart."""
