"""The worker pools: each worker's health, circuit breaker, directory and kind, discovered
and kept fresh in the background, and the prefills registered with the index as pods."""
