"""Build stages and registries of the i.MX 8M Plus model zoo."""
