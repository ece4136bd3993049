"""Eviction policies (the tiered-cache issue); the host tier has a fixed capacity until then."""
