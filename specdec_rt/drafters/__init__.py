"""Drafters that need no model backend: n-gram lookup, and combinations of drafters."""
