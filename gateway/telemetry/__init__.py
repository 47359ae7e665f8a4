"""What the gateway tells of itself: its Prometheus metrics (`metrics`) and the trace
context and OpenTelemetry spans of its requests (`tracing`)."""
