"""The engine: `Engine` and `AsyncEngine`, the engine core's step loop, the input and output processors."""
