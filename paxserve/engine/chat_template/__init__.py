"""Chat templates rendered in a sandbox with limits."""
