"""Models and tokenizers, GGUF files, device and precision, CPU threads."""
