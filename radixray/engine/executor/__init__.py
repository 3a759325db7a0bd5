"""Running a batch on the model: the model runner, forward batches, the sampler, sequence scoring."""
