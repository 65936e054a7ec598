"""LoRA adapters: files in PEFT format, and the registry that publishes versions to serving replicas."""
