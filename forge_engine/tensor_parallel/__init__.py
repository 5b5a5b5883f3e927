"""Tensor parallelism: one model split over processes, one GPU each (chapters 09c-09g)."""
