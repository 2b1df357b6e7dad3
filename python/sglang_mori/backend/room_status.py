"""SGLang's KVPoll values, mirrored so the services and their tests need not import SGLang (which
pulls in torch). sglang_compat checks at import that they equal SGLang's own."""

FAILED = 0
BOOTSTRAPPING = 1
WAITING_FOR_INPUT = 2
TRANSFERRING = 3
SUCCESS = 4

TERMINAL = (SUCCESS, FAILED)
