"""Numeric kernels. Each op has a pure-torch reference; faster versions register beside it."""
