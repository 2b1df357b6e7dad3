"""Decode role: rooms (state machines), reachability (bootstrap failures), service (status thread,
messages; decides), effects (the one writer of SGLang's room tables and the one failure path)."""
