"""RL on radixray: GRPO jobs that roll out through the fleet, train, and push weights back."""
