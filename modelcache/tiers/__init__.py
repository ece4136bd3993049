"""Storage tiers: disk (the repository, source of truth) and host shared memory."""
