"""The whole stack on one machine: supervised processes, `globalkv up` and `globalkv doctor`.

Nothing here imports `gateway/` or `enginesim/`: every component runs as its own
`python -m globalkv <command>` child configured by flags, exactly as a user would start
it, so a local cluster exercises the same entry points as a production deployment.
"""
