"""A connected PULL/PUSH pair on loopback, the inbox tests' socket and one sender to it."""

import zmq


def pull_push(ctx: zmq.Context):
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.LINGER, 0)  # a test's unsent message must not hold its exit
    push.connect(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
    return pull, push
