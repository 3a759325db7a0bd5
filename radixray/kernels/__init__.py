"""Numeric kernels. Each op has a pure-torch reference; faster versions register beside it."""

# The quantization methods int8_linear implements. Here, not there, so that the engine's
# config (read by the controller and the router, which never run a model) names them
# without importing torch.
QUANTIZATIONS = (None, "w8a8_int8")
