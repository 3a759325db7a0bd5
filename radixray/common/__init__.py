"""Helpers every layer may use: no torch, no Ray, no radixray imports."""
