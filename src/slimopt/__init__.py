"""slimopt: memory-lean optimizers for training and fine-tuning language models."""

__version__ = "0.1.0"
