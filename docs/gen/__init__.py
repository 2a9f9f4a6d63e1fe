"""The generators of the reference pages (docs/hooks.py calls them)."""
