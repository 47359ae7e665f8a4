"""`globalkv gateway`: the gateway standing alone in front of the workers, receiving each
request on its own HTTP server and running the PD legs (sglang-router's place)."""
