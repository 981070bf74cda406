"""paxserve's OpenAI-compatible HTTP server (aiohttp). Never imports JAX: the engine arrives as an
AsyncEngine and is only touched on its own thread.

    from paxserve.server.app import create_app
    app = create_app(async_engine, ServerSettings(served_model_names=["my-model"]))
"""
