"""Storage tiers (local CPU, Redis) and the manager that puts them in front of each other."""
