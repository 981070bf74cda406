"""Sampling: host-side per-row inputs and the on-device sampler."""
