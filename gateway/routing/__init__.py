"""Choosing a pair: the index lookup, a policy per role, the rooms. Nothing is sent here."""
