"""The PD gateway, in two levels.

`http/` is the HTTP/1.1 server and client, knowing nothing of prefill or decode; the PD
logic is `routing/` with `policies/` (choose a pair), `legs/` (run SGLang's or vLLM's legs
on it, with retries and the deadline), `workers/` (the pools, kept fresh in the background)
and `replicas/` (state shared with other gateways). `inference` joins them for one request;
`cli` and `service` build and wire the whole.
"""
