"""Pure-Python scheduling: requests, the scheduler, the KV cache manager and block pool, and the
plain data that crosses the engine's seams. Imports no JAX."""
