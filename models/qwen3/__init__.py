"""Qwen3, dense and MoE: ``flavors`` (arguments, sizes, FLOPs per token), ``model`` (GQA attention
with QK-norm; a dense SwiGLU or ``models.moe``'s MoE in every block), ``hf`` (``Qwen3ForCausalLM``
and ``Qwen3MoeForCausalLM``) and ``parallelize`` (its TP + EP + SimpleFSDP plan). Import from those
modules: this package's own module imports nothing, so that the model layer and the parallel layer
stay apart."""
