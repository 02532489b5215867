"""Integrations with other libraries (optional dependencies)."""
