"""Expert parallelism: the EP group, dispatchers (collectives, DeepEP), expert placement and EPLB."""
