"""Model architectures, configs, weight loading and tokenizers."""
