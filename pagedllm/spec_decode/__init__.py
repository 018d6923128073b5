"""Speculative decoding: proposers, verification and rejection sampling."""
