"""Models: ``spec`` (a Hugging Face config resolved into per-layer descriptors, shared by both halves below),
``architectures/`` (the torch modules), ``loading/`` (checkpoints, GGUF, presets: building a model and filling
its weights), ``tokenizer`` and ``chat_templates`` (the text side)."""
