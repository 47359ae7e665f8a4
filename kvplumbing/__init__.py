"""What several of globalkv's packages need, written once: the bottom of the layering.

Every other package may import it; it imports none of ours (the import contracts in
`pyproject.toml` hold it to that). A piece belongs here when two packages would otherwise
each write it: backoff delays, the ASGI body limit and the client-disconnect race, the
words of a pydantic error and of a failed HTTP exchange, `kv@<pod>@<model>` topics, DP-rank
endpoints, bearer checks and protected mode, what counts as a host a peer may name, the
environment variable of a flag, the clock and sleep types that make time injectable,
stopping background tasks for good, and the release's version.
"""
