"""What the training loop uses beside the graph: a step's gradients, the optimizer, metrics, guards,
preflight checks, gradient records."""
