"""Model architectures running on flat token batches."""
