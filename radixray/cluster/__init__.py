"""Ray-free fleet logic that the actors run: routing policies, the router's prefix tree,
circuit breakers, the worker registry, the serving config schema, metrics families and
the errors that cross process boundaries."""
