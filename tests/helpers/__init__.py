"""Helpers shared by a unit test file and the integration file beside it (no tests here)."""
