"""Measuring what a trained DiT generates."""
