"""The scheduler and everything that decides a step: queues, admission, batches, decode strategies, output processing, faults."""
