"""One worker's engine, usable in-process without Ray."""
