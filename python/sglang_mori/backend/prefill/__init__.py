"""Prefill role: rooms (state machines), effects (the one applier of their effects), control
(decode's messages), submitter (chunk-wise writes), completion (conclude, drain, ACK), failures
(the one failure door), service (threads)."""
