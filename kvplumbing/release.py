"""The installed globalkv release, read once from the package metadata, so `--version`,
every service's `/version` and the image labels name the same thing."""

from __future__ import annotations

from importlib.metadata import version

VERSION = version("globalkv")
