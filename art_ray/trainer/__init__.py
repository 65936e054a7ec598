"""The learning half: GRPO on trajectory groups with a DeepSpeed LoRA trainer (issue 4, in progress)."""
