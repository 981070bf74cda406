"""Per-family modules: each maps its Hugging Face config onto the decoder spec (`ModelConfig`) and
its tensor names onto the params pytree (`models.layout.Layout`); none has a forward of its own."""
