"""What train.py composes: run config and CLI, optimizer and schedule, atomic checkpoints, evaluation."""
