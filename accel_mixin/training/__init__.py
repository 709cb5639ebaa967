"""Training on every rank: the objects accelerate prepares, the step, an epoch."""
