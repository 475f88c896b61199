"""Speculative decoding: the configuration (``--speculative-config``, vLLM's JSON) and the
proposers that draft tokens for the target model to verify (models/rejection_sampler.py)."""
