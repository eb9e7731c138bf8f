"""DeepSeek-V3: ``flavors`` (arguments, sizes, FLOPs per token), ``model`` (MLA attention, MoE with
routed + shared experts, aux-loss-free load balancing) and ``parallelize`` (its EP + SimpleFSDP
plan). Import from those modules: this package's own module imports nothing, so that the model
layer and the parallel layer stay apart."""
