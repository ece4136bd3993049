"""Serve-mode executor (the serve-mode issue)."""
