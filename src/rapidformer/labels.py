"""What a label says to a loss."""

IGNORE_INDEX = -100
"""The label a loss skips: torch's cross-entropy default, and every task's and collate's."""
