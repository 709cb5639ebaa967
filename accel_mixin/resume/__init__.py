"""Training states and resuming from them exactly: what is saved, which run
it belongs to, and the plan that applies it to the next fit."""
