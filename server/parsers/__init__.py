"""Reading a model's own output formats: tool calls (`tool_calls/`, --tool-call-parser) and thinking
(`reasoning.py`, --reasoning-parser)."""
