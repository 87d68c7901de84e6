"""Runnable examples: ``python -m zerocore.examples.train_gpt --help``."""
