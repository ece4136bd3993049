"""The resident model manager: registry of models, leases, tiers."""
