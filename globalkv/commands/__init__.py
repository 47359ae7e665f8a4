"""The `globalkv` subcommands this package contributes: indexer, lookup, pods."""
