"""Server-side capture: the endpoint records every completion of a capture session, so an agent written
with any framework (or none) becomes a trainable Trajectory without handling token ids itself."""
