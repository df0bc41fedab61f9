"""The speculative loop: the scheduler, the Protocols it talks to, one request's state."""
