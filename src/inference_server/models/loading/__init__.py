"""Where a model comes from: Hugging Face folders, GGUF files (the embedded default), presets with dummy weights;
builds the architecture and fills its weights."""
