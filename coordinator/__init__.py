"""fedge's coordinator: fleet registry, selection, the round state machine, strategies, durable state."""
