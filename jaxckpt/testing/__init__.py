"""Helpers for testing jaxckpt and stores built on it."""
