"""Integrations with other training stacks (transformers.Trainer)."""
