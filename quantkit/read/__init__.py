"""Reading checkpoints: validated safetensors headers, the checkpoint directory and its index, what format
the source stores each module in, and one tensor reader that every command reads weights through."""
