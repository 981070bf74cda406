"""paxserve: a vLLM-class LLM serving engine on JAX."""

__version__ = "0.1.0"
