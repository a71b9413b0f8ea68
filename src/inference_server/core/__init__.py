"""Trio-free engine logic: data structures and algorithms (no trio, no Quart)."""
