"""kvpress: KV-cache compression and sparse decoding for Hugging Face transformers models."""
__version__ = "0.1.0"
