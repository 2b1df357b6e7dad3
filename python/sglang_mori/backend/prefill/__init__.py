"""Prefill role: rooms (state machines), control (decode's messages), submitter (chunk-wise
writes), completion (conclude, drain, ACK), failures (the one failure path), service (threads)."""
