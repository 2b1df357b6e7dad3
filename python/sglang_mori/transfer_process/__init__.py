"""A prefill transfer process (issue 28 prototype, SGLANG_MORI_TRANSFER_PROCESS=on).

One child process per prefill rank owns the transfer engine and runs the prefill service's threads
(control, shards, completion) on pools it imports from the scheduler's process; the scheduler keeps
only SGLang's calls into us. Parts, one purpose each:
- status_table.py: shared memory, child -> scheduler: one status slot per room, read by poll();
- handoff.py:      records, scheduler -> child, over an AF_UNIX SOCK_SEQPACKET pair;
- pools.py:        what the child needs to map the KV pools (CUDA IPC or /dev/shm), or a refusal;
- child_tables.py: the child's stand-in for SGLang's per-room tables (statuses into the table);
- child.py:        the child's main: engine, imported pools, the service, the hand-off reader;
- client.py:       the scheduler's side: spawn, hand-offs, statuses, the child's death.
"""
