"""Decode role: rooms (state machines), reachability (bootstrap failures), service (status thread,
messages, the one failure path)."""
