"""The PD gateway: three entry points over one core.

The entry points stand side by side and none imports another: `standalone` (`globalkv
gateway`, in sglang-router's place), `epp` (the endpoint picker behind Envoy) and
`sidecar` (in front of one decode). The core they share: `serving` reads a request once
and serves it (the inference handler; the parts built, wired and run), over `settings`
(the one configuration and its flags), `requests` (bodies, namespaces, headers),
`routing` with `policies` (choose a pair), `load` (each worker's load), `legs` (run
SGLang's or vLLM's legs on a pair, with retries and the deadline), `workers` (the pools,
kept fresh in the background), `flow` (what holds a request back), `replicas` (state
shared with other gateways) and `telemetry` (metrics, traces). `http` is the HTTP/1.1
server and client, knowing nothing of prefill or decode.
"""
